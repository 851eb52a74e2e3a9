"""Render deploy/nginx/pagedserve.conf.template for a list of replicas (stdlib only).

    python3 deploy/nginx/render.py --listen 8000 10.0.0.11:8000 10.0.0.12:8000 > pagedserve.conf

With `--standalone DIR` it writes DIR/nginx.conf, a complete configuration that runs nginx in the
foreground without root or the system's nginx.conf (pid, logs and temp files under DIR):

    python3 deploy/nginx/render.py --listen 8080 --standalone /tmp/lb 127.0.0.1:8001 127.0.0.1:8002
    nginx -p /tmp/lb -e /tmp/lb/logs/error.log -c /tmp/lb/nginx.conf
"""

from __future__ import annotations

import argparse
import os
import re
import sys

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pagedserve.conf.template")
TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


MODES = ("affinity", "least_conn")
RING_WEIGHT = 10
JS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pagedserve_route.js")
# Where Debian's libnginx-mod-http-js puts the njs module (a system nginx loads it itself, through
# /etc/nginx/modules-enabled/; a --standalone one is told with load_module).
NJS_MODULE = "/usr/lib/nginx/modules/ngx_http_js_module.so"


def render(
    listen: str,
    replicas: list[str],
    max_fails: int = 1,
    fail_timeout: str = "10s",
    mode: str = "affinity",
    session_header: str = "X-Session-ID",
    prefix_chars: int = 256,
    js_file: str = JS_FILE,
    replica_header: bool = False,
    servers_include: str | None = None,
    max_conns: int | None = None,
) -> str:
    """The http{}-level configuration: one `server` line per replica (host:port).

    `mode`: "affinity" (njs routing key, consistent hash, a replica's 503 spills to the least
    loaded replica) or
    "least_conn". `replica_header`:
    answers carry X-Pagedserve-Replica (the replica's address; for benchmarks and tests).
    `servers_include`: the upstreams include PATH, PATH.home and PATH.spill (written where the
    replicas are known: the Kubernetes router's init container) instead of naming `replicas`.
    `max_conns` (affinity): the requests in flight a replica takes before the hash walks on to
    the next replica on the ring (None: no bound in nginx)."""
    if not replicas and servers_include is None:
        raise ValueError("give at least one replica as host:port")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    with open(TEMPLATE) as f:
        text = keep_mode(f.read(), mode)
    if max_conns is not None and (mode != "affinity" or max_conns < 1):
        raise ValueError("max_conns bounds the affinity mode's hash and must be at least 1")
    # affinity: nginx puts 160 x weight points per replica on the hash ring; 1600 keep every
    # replica's share of the keys within ~4% of the others' (160: ~12%, 25% at the 90th pct).
    ring = f" weight={RING_WEIGHT}" if mode == "affinity" else ""
    home = f"server {{}} max_fails={max_fails} fail_timeout={fail_timeout}{ring};"
    line = home[:-1] + (f" max_conns={max_conns};" if max_conns else ";")
    header = "add_header X-Pagedserve-Replica $upstream_addr always;" if replica_header else ""
    values = {
        "SERVERS": [line.format(r) for r in replicas],
        "HOME_SERVERS": [home.format(r) for r in replicas],
        "SPILL_SERVERS": [f"server {r} max_fails=0;" for r in replicas],
        "REPLICA_HEADER": [header or "# (render.py --replica-header: X-Pagedserve-Replica)"],
    }
    if servers_include is not None:
        values["SERVERS"] = [f"include {servers_include};"]
        values["SPILL_SERVERS"] = [f"include {servers_include}.spill;"]
        values["HOME_SERVERS"] = [f"include {servers_include}.home;"]
    for name, lines in values.items():
        # Only placeholders alone on their line (comments name them too).
        text = re.sub(rf"^( *)\{{\{{{name}\}}\}}$",
                      lambda m, ls=lines: "\n".join(m[1] + x for x in ls), text, count=1,
                      flags=re.M)  # fmt: skip
    inline = {
        "LISTEN": listen, "JS_FILE": js_file, "SESSION_HEADER": session_header,
        "PREFIX_CHARS": str(prefix_chars),
    }  # fmt: skip
    for name, value in inline.items():
        text = text.replace("{{" + name + "}}", value)
    return text


def keep_mode(text: str, mode: str) -> str:
    """The template without the `#@other_mode ... #@end` blocks and without the markers."""
    out, keep = [], True
    for line in text.splitlines(keepends=True):
        marker = line.strip()
        if marker.startswith("#@"):
            keep = marker in ("#@end", f"#@{mode}")
            continue
        if keep:
            out.append(line)
    return "".join(out)


def standalone(directory: str, http_conf: str, njs_module: str | None = NJS_MODULE) -> str:
    """A whole nginx.conf around `http_conf`, every path under `directory`; returns its path.
    `njs_module` is loaded when the configuration uses njs (affinity mode)."""
    directory = os.path.abspath(directory)
    os.makedirs(os.path.join(directory, "logs"), exist_ok=True)
    for name in TEMP_DIRS:
        path = os.path.join(directory, "temp", name)
        os.makedirs(path, exist_ok=True)
        # Workers of an nginx started as root run as `nobody`: let them write temp files.
        os.chmod(path, 0o1777)
    temp = "\n".join(f"    {n}_temp_path {directory}/temp/{n};" for n in TEMP_DIRS)
    indented = "\n".join(("    " + line) if line else "" for line in http_conf.splitlines())
    uses_njs = njs_module and "js_import" in http_conf
    load = f"load_module {njs_module};\n" if uses_njs else ""
    conf = f"""# Generated by deploy/nginx/render.py --standalone.
{load}daemon off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/logs/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log {directory}/logs/access.log;
{temp}

{indented}
}}
"""
    path = os.path.join(directory, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("replicas", nargs="*", metavar="HOST:PORT")
    p.add_argument("--listen", default="8000", help="nginx's listen address (port or host:port)")
    p.add_argument("--max-fails", type=int, default=1)
    p.add_argument("--fail-timeout", default="10s")
    p.add_argument("--mode", choices=MODES, default="affinity")
    p.add_argument("--session-header", default="X-Session-ID")
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=256,
        help="affinity: characters of a completions prompt that make its key",
    )
    p.add_argument("--js-file", default=JS_FILE, help="where nginx finds pagedserve_route.js")
    p.add_argument(
        "--replica-header",
        action="store_true",
        help="add X-Pagedserve-Replica (the replica's address) to every answer",
    )
    p.add_argument(
        "--servers-include",
        metavar="PATH",
        help="upstreams include PATH (and PATH.home, PATH.spill) instead of listing replicas",
    )
    p.add_argument(
        "--max-conns",
        type=int,
        metavar="C",
        help="affinity: a replica with C requests in flight spills the next to the "
        "next replica on the ring (e.g. the replicas' --max-num-seqs)",
    )
    p.add_argument("--njs-module", default=NJS_MODULE, help="--standalone: njs module to load")
    p.add_argument("--standalone", metavar="DIR", help="write DIR/nginx.conf, a complete config")
    args = p.parse_args(argv)
    conf = render(
        args.listen, args.replicas, args.max_fails, args.fail_timeout, args.mode,
        args.session_header, args.prefix_chars, args.js_file,
        args.replica_header, args.servers_include, args.max_conns,
    )  # fmt: skip
    if args.standalone:
        path = standalone(args.standalone, conf, args.njs_module)
        d = os.path.dirname(path)
        print(f"nginx -p {d} -e {d}/logs/error.log -c {path}")
    else:
        sys.stdout.write(conf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
