"""The four output-channel modes every transport test runs in."""

MODES = [("posix", False), ("sysv", False), ("posix", True), ("sysv", True)]
MODE_IDS = ["posix-ring", "sysv-ring", "posix-chunked", "sysv-chunked"]
