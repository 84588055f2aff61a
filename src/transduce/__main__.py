from transduce.cli import main

raise SystemExit(main())
