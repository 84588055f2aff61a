"""The shapes of JSON Schema's string formats, as the patterns a generated string keeps
(json_schema.py): what Pydantic's datetime, date, time, timedelta, UUID, EmailStr,
IPv4Address, IPv6Address and URLs are written with, in forms Python's datetime and Pydantic read
back. Dates are calendar dates (February 29th in leap years only, years 0001 to 9999);
times have no leap second. Formats not here are annotations, read past.
"""

_YEAR = r"([1-9]\d{3}|0[1-9]\d\d|00[1-9]\d|000[1-9])"
_LEAP_YEAR = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
         rf"|02-(0[1-9]|1\d|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HEX = "[0-9a-fA-F]"
_GROUP = f"{_HEX}{{1,4}}"
_IPV6 = "|".join([f"({_GROUP}:){{7}}{_GROUP}", f"({_GROUP}:){{1,7}}:"]
                 + [f"({_GROUP}:){{1,{7 - tail}}}(:{_GROUP}){{1,{tail}}}" for tail in range(1, 7)]
                 + [f":((:{_GROUP}){{1,7}}|:)"])      # written in full, or with one ::
# A duration's numbers take at most 6 digits, which Python's timedelta holds.
_N = r"\d{1,6}"
_SECONDS = rf"{_N}(\.{_N})?S"
_TIME_PART = rf"T({_N}H({_N}M)?({_SECONDS})?|{_N}M({_SECONDS})?|{_SECONDS})"
_DATE_PART = rf"({_N}Y({_N}M)?({_N}D)?|{_N}M({_N}D)?|{_N}D)"

FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": rf"^P({_N}W|{_DATE_PART}({_TIME_PART})?|{_TIME_PART})$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "email": rf"^[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+)*"
             rf"@({_LABEL}\.)+{_LABEL}$",
    "hostname": rf"^{_LABEL}(\.{_LABEL})*$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "ipv6": f"^({_IPV6})$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\x00-\x20\"<>\\^`{|}\x7f]+$",
}
