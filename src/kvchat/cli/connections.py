"""``kvchat connections``: saved connections to OpenAI-compatible servers; their keys go to the
OS keyring."""
import sys

from kvchat.core.config import ConfigError


def connections_args(sub) -> None:
    con = sub.add_parser("connections", help="saved connections to OpenAI-compatible servers (the app's and "
                         "--remote NAME's); API keys go to the OS keyring")
    action = con.add_subparsers(dest="action", metavar="add|list|remove")
    add = action.add_parser("add", help="save a connection (an existing name is replaced)")
    add.add_argument("name")
    add.add_argument("url", help="the server's base URL, e.g. http://gpu-box:8000")
    add.add_argument("--model", default=None, help="one of the server's models (default: its first)")
    add.add_argument("--api-key-stdin", action="store_true",
                     help="read the API key from standard input (never from the command line, where "
                          "other users and the shell history would see it)")
    action.add_parser("list", help="the saved connections, without their keys")
    rm = action.add_parser("remove", help="forget a connection and its key")
    rm.add_argument("name")


def cmd_connections(args) -> int:
    from kvchat.core.connections import Connection, Connections, KeyringUnavailable, connection_problem, get_key

    saved = Connections()
    if args.action == "list":
        rows = saved.all()
        for c in rows:
            key = "key in keyring" if get_key(c.name) else "no key"
            print(f"{c.name}\t{c.base_url}\t{c.model or '(first model)'}\t{key}")
        if not rows:
            print("no saved connections (add one: kvchat connections add NAME URL)", file=sys.stderr)
        return 0
    if args.action == "remove":
        if saved.get(args.name) is None:
            raise ConfigError(f"no saved connection named {args.name!r} (see: kvchat connections list)")
        saved.remove(args.name)
        print(f"removed {args.name}")
        return 0
    if args.action != "add":
        raise ConfigError("say what to do: kvchat connections add NAME URL | list | remove NAME")
    name, url = args.name.strip(), args.url.strip()
    problem = connection_problem(name, url)
    if problem:
        raise ConfigError(problem)
    key = sys.stdin.readline().strip() if args.api_key_stdin else None
    if args.api_key_stdin and not key:
        raise ConfigError("--api-key-stdin read no key from standard input")
    replaced = saved.get(name) is not None
    try:
        saved.save(Connection(name, url, args.model), api_key=key)
    except KeyringUnavailable as e:
        raise ConfigError(str(e)) from None
    print(f"{'updated' if replaced else 'saved'} {name}: {url}" + (" (key in the OS keyring)" if key else ""))
    return 0
