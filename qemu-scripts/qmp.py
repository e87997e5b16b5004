#!/usr/bin/env python3
"""A minimal QMP client (standard library only) for qemu-scripts/migrate.sh
and for operators.

    qmp.py SOCKET COMMAND [ARGUMENTS] [--get KEY[.KEY...]] [--timeout SECS]

Connects to a QEMU started with -qmp unix:SOCKET,server=on,wait=off,
negotiates capabilities, runs COMMAND with ARGUMENTS (a JSON object, e.g.
'{"uri": "unix:/run/mig.sock"}'), prints its "return" value as one line of
JSON and exits 0. --get prints one field of it instead (strings bare), e.g.
`qmp.py SOCK query-migrate --get status`; a missing field prints nothing.
Exits 1 when QEMU answers with an error (printed on stderr as "CLASS: desc"),
2 on usage errors, 3 when QEMU cannot be reached or does not answer within
--timeout seconds (default 30). Asynchronous events QEMU sends meanwhile are
skipped.

Examples:
  qmp.py /run/vm1.qmp query-status --get status
  qmp.py /run/vm1.qmp migrate-set-parameters '{"downtime-limit": 500}'
  qmp.py /run/vm1-new.qmp migrate-incoming '{"uri": "unix:/run/vm1-mig.sock"}'
  qmp.py /run/vm1.qmp migrate '{"uri": "unix:/run/vm1-mig.sock"}'
  qmp.py /run/vm1.qmp query-migrate
"""
import json
import socket
import sys


def fail(code, msg):
    print(f"qmp.py: {msg}", file=sys.stderr)
    sys.exit(code)


def main(argv):
    args = []
    get = None
    timeout = 30.0
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        if a in ("--get", "--timeout"):
            if i + 1 >= len(argv):
                fail(2, f"{a} needs a value")
            if a == "--get":
                get = argv[i + 1]
            else:
                try:
                    timeout = float(argv[i + 1])
                except ValueError:
                    fail(2, f"--timeout '{argv[i + 1]}' is not a number")
            i += 2
            continue
        args.append(a)
        i += 1
    if len(args) not in (2, 3):
        fail(2, "usage: qmp.py SOCKET COMMAND [ARGUMENTS-JSON] [--get KEY] [--timeout SECS] (see --help)")
    path, command = args[0], args[1]
    arguments = None
    if len(args) == 3:
        try:
            arguments = json.loads(args[2])
        except json.JSONDecodeError as e:
            fail(2, f"ARGUMENTS is not JSON: {e}")
        if not isinstance(arguments, dict):
            fail(2, "ARGUMENTS must be a JSON object")

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError as e:
        fail(3, f"cannot connect to {path}: {e}")
    f = s.makefile("rwb")

    def receive():
        """The next reply that is not an event."""
        while True:
            try:
                line = f.readline()
            except OSError as e:
                fail(3, f"{path}: {e}")
            if not line:
                return None
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    def send(cmd, cmd_args=None):
        msg = {"execute": cmd}
        if cmd_args is not None:
            msg["arguments"] = cmd_args
        try:
            f.write(json.dumps(msg).encode() + b"\n")
            f.flush()
        except OSError as e:
            fail(3, f"{path}: {e}")
        return receive()

    greeting = receive()
    if greeting is None or "QMP" not in greeting:
        fail(3, f"{path}: no QMP greeting")
    reply = send("qmp_capabilities")
    if reply is None or "return" not in reply:
        fail(3, f"{path}: qmp_capabilities failed: {reply}")
    reply = send(command, arguments)
    if reply is None:
        # "quit" may close the socket before its reply arrives.
        if command == "quit":
            return 0
        fail(3, f"{path}: QEMU closed the connection without answering {command}")
    if "error" in reply:
        err = reply["error"]
        print(f"{err.get('class', 'Error')}: {err.get('desc', err)}", file=sys.stderr)
        return 1
    value = reply.get("return")
    if get is not None:
        for key in get.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            return 0
        print(value if isinstance(value, str) else json.dumps(value))
    else:
        print(json.dumps(value))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
