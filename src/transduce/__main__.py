from transduce.cli import main

if __name__ == "__main__":     # not when a spawned process imports it as its __mp_main__
    raise SystemExit(main())
