"""Serve one of our scorers (or any Scorer class) over HTTP for the ``remote`` reward (rewards/remote.py).

    python scripts/reward_server.py --scorer pickscore --arg model_path=/ckpt/PickScore_v1 \
        --arg processor_path=/ckpt/CLIP-H --device cuda:0 --port 8100
    python scripts/reward_server.py --scorer-class my_package.ocr:OCRScorer --port 8100

The trainer then uses ``+reward.components.remote={url: http://127.0.0.1:8100, weight: 1.0}``. The
server listens on 127.0.0.1 unless ``--host`` says otherwise, refuses bodies over ``--max-mb``, and,
when ``JAGG_REWARD_TOKEN`` is set in its environment, every request without that bearer token.
Requests are scored one at a time (one lock), so a GPU scorer never sees two batches at once. Every answer
names the scorer and its arguments, so a trainer notices a server restarted with another one. A mistake in
the arguments is one line naming the ``--arg`` (or option) and exit status 2.
Needs the ``server`` extra: pip install -e ".[server]" (FastAPI and uvicorn); without it, one line says so.
"""

from __future__ import annotations

import argparse
import ast
import errno
import hmac
import importlib
import inspect
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping
from typing import NoReturn

import torch

from rewards.base import SCORER_NAMES, Scorer, scorer_class
from rewards.remote import TOKEN_ENV, decode_batch

try:
    import uvicorn
    from fastapi import FastAPI, HTTPException, Request
except ImportError as missing:  # the extra is not installed here: one line that says how, not a traceback
    print(
        f"reward_server.py: error: {missing.name or 'fastapi'} is not installed: the reward server needs the server "
        'extra, pip install -e ".[server]" (FastAPI and uvicorn)',
        file=sys.stderr,
    )
    raise SystemExit(2) from None

PROG = "reward_server.py"
CLIENTS = ("remote", "judge")  # scorers that call a server themselves: nothing to serve


def make_app(
    scorer: Scorer, *, max_bytes: int, token: str | None, arguments: Mapping[str, object] | None = None
) -> FastAPI:
    """The HTTP app of ``scorer``, built with ``arguments``: GET /health and POST /score (the protocol of
    rewards/remote.py); every answer names the scorer and its arguments."""
    app = FastAPI(title=f"jagg reward server: {scorer.name}")
    lock = threading.Lock()
    identity = {"scorer": scorer.name, "arguments": dict(arguments or {})}

    def authorize(request: Request) -> None:
        sent = request.headers.get("authorization", "")
        if token is not None and not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, f"missing or wrong bearer token (the server's {TOKEN_ENV})")

    @app.get("/health")
    def health(request: Request) -> dict:
        authorize(request)
        return identity

    @app.post("/score")
    async def score(request: Request) -> dict:
        authorize(request)
        declared = int(request.headers.get("content-length") or 0)
        if declared > max_bytes:
            raise HTTPException(413, f"body of {declared} bytes exceeds the server's limit of {max_bytes}")
        raw = await request.body()
        if len(raw) > max_bytes:
            raise HTTPException(413, f"body of {len(raw)} bytes exceeds the server's limit of {max_bytes}")
        try:
            images, prompts = decode_batch(await request.json())
        except ValueError as err:
            raise HTTPException(400, f"malformed request: {err}") from None
        with lock, torch.no_grad():
            scores = scorer(images, prompts)
        return {"scores": [float(s) for s in scores.cpu()], **identity}

    return app


def fail(message: str) -> NoReturn:
    """End the server with one line naming the option to fix, and exit status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own mistakes: one line too, without the usage
        fail(message)


def scorer_type(name: str | None, class_path: str | None) -> type[Scorer]:
    """The registered scorer ``name``, or the Scorer class at ``module:Class``."""
    if class_path is None:
        return scorer_class(name or "")
    module_name, _, class_name = class_path.partition(":")
    if not module_name or not class_name:
        fail(f"--scorer-class {class_path!r} must be module:Class")
    try:
        found = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError as err:
        fail(f"--scorer-class {class_path!r}: cannot import {module_name} ({err})")
    if not (isinstance(found, type) and issubclass(found, Scorer)):
        fail(f"--scorer-class {class_path!r} is not a Scorer class (rewards/base.py) in {module_name}")
    return found


def _argument_error(cls: type[Scorer], kwargs: dict[str, object], err: Exception) -> str:
    """The one line of a scorer's refusal of its arguments, naming the --arg it is about."""
    parameters = [n for n in inspect.signature(cls).parameters if n not in ("self", "args", "kwargs")]
    accepted = f" (its arguments: {', '.join(parameters) or 'none'})"
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as unbound:
        return f"--arg: {unbound}{accepted}"
    message = str(err)
    first = re.match(r"[A-Za-z_]\w*", message)
    key = first.group() if first and first.group() in kwargs else None
    return f"--arg {key}={kwargs[key]!r}: {message}" if key else f"--scorer {cls.name}: {message}{accepted}"


def load_scorer(name: str | None, class_path: str | None, kwargs: dict[str, object], device: str) -> Scorer:
    """One of our registered scorers by ``name``, or the class at ``module:Class``, on ``device``; one line
    naming the --arg for arguments it refuses (a wrong name, a value out of range, a missing file)."""
    cls = scorer_type(name, class_path)
    try:
        scorer = cls(**kwargs)
    except (TypeError, ValueError, FileNotFoundError) as err:
        fail(_argument_error(cls, kwargs, err))
    return scorer.to(device)


def arg_value(text: str) -> object:
    """A --arg value: a Python literal (95, 0.5, True) when it parses as one, else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--scorer", choices=[n for n in SCORER_NAMES if n not in CLIENTS], help="a registered scorer")
    which.add_argument("--scorer-class", help="module:Class of a Scorer (rewards/base.py) to import")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="a constructor argument")
    parser.add_argument("--device", default="cpu", help="where the scorer runs (cpu, cuda:0, ...)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8100, help="port to listen on, 1 to 65535")
    parser.add_argument("--max-mb", type=float, default=256.0, help="largest request body, in MiB, > 0")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        fail(f"--port must be in 1 to 65535, got {args.port}")
    if not 0 < args.max_mb < float("inf"):
        fail(f"--max-mb must be a number > 0, got {args.max_mb}")
    if bad := [a for a in args.arg if "=" not in a]:
        fail(f"--arg must be KEY=VALUE, got {bad[0]!r}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        fail(f"--device {args.device!r} is not a device: cpu, cuda, cuda:<index>, ...")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}, but CUDA is not available on this machine: pass --device cpu")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kwargs = {key: arg_value(value) for key, value in (a.split("=", 1) for a in args.arg)}
    scorer = load_scorer(args.scorer, args.scorer_class, kwargs, args.device)
    token = os.environ.get(TOKEN_ENV) or None
    app = make_app(scorer, max_bytes=int(args.max_mb * 2**20), token=token, arguments=kwargs)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening(args.host, args.port)])


def listening(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port``; one line naming --host or --port when the address cannot be had."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        fail(f"--host {host!r} is not an address ({err.strerror})")
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            fail(f"--port {port} is in use on {host} (another server runs there?): pick another --port")
        fail(f"--host {host}: {err.strerror} (an address of this machine, e.g. 127.0.0.1 or 0.0.0.0)")
    return sock


if __name__ == "__main__":
    main()
