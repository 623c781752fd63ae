"""`quillcache secret`: show or rotate the gateway secret, hash an API key for the config."""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("show", "print the secret's fingerprints (never the secret)"),
        ("rotate", "make a new secret; the old one stays accepted for --window-s"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--file", default=None, help="the secret file (default: the gateway's)")
        if name == "rotate":
            p.add_argument(
                "--window-s",
                type=float,
                default=86_400.0,
                help="how long the previous secret's fingerprint stays accepted",
            )
    h = sub.add_parser(
        "hash-key",
        help="the sha256 of an API key, for `api_keys: [{sha256, tenant}]`",
        description="Reads the key from stdin (or asks for it): it stays out of shell history.",
    )
    h.add_argument("--tenant", default=None, help="print a config entry for this tenant")


def run(args: argparse.Namespace) -> int:
    from quillcache.gateway.secret import load_or_create, rotate
    from quillcache.gateway.tenancy import hash_key

    if args.action == "hash-key":
        key = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("key: ")
        if not key:
            print("secret hash-key: an empty key", file=sys.stderr)
            return 2
        entry = {"sha256": hash_key(key), **({"tenant": args.tenant} if args.tenant else {})}
        print(json.dumps(entry) if args.tenant else entry["sha256"])
        return 0
    path = Path(args.file) if args.file else None
    secret = rotate(path, args.window_s) if args.action == "rotate" else load_or_create(path)
    info = secret.as_dict()
    print(f"file: {info['path']}")
    print(f"fingerprint: {info['fingerprint']}")
    if secret.previous_until is not None:
        until = datetime.datetime.fromtimestamp(secret.previous_until, datetime.UTC)
        print(f"previous accepted until: {until.isoformat(timespec='seconds')}")
    if args.action == "rotate":
        print("restart every gateway of the fleet to use the new secret", file=sys.stderr)
    return 0
