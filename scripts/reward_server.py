"""Serve one of our scorers (or any Scorer class) over HTTP for the ``remote`` reward (rewards/remote.py).

    python scripts/reward_server.py --scorer pickscore --arg model_path=/ckpt/PickScore_v1 \
        --arg processor_path=/ckpt/CLIP-H --device cuda:0 --port 8100
    python scripts/reward_server.py --scorer-class my_package.ocr:OCRScorer --port 8100

The trainer then uses ``+reward.components.remote={url: http://127.0.0.1:8100, weight: 1.0}``. The
server listens on 127.0.0.1 unless ``--host`` says otherwise, refuses bodies over ``--max-mb``, and,
when ``JAGG_REWARD_TOKEN`` is set in its environment, every request without that bearer token.
Requests are scored one at a time (one lock), so a GPU scorer never sees two batches at once.
Needs the ``server`` extra: pip install -e .[server] (FastAPI and uvicorn).
"""

from __future__ import annotations

import argparse
import ast
import hmac
import importlib
import os
import threading

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request

from rewards.base import SCORER_NAMES, Scorer, build_scorer
from rewards.remote import TOKEN_ENV, decode_batch


def make_app(scorer: Scorer, *, max_bytes: int, token: str | None) -> FastAPI:
    """The HTTP app of ``scorer``: GET /health and POST /score (the protocol of rewards/remote.py)."""
    app = FastAPI(title=f"jagg reward server: {scorer.name}")
    lock = threading.Lock()

    def authorize(request: Request) -> None:
        sent = request.headers.get("authorization", "")
        if token is not None and not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, f"missing or wrong bearer token (the server's {TOKEN_ENV})")

    @app.get("/health")
    def health(request: Request) -> dict:
        authorize(request)
        return {"scorer": scorer.name}

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
        return {"scores": [float(s) for s in scores.cpu()]}

    return app


def load_scorer(name: str | None, class_path: str | None, kwargs: dict[str, object], device: str) -> Scorer:
    """One of our registered scorers by ``name``, or the class at ``module:Class``, on ``device``."""
    if class_path is None:
        scorer = build_scorer(name or "", **kwargs)
    else:
        module_name, _, class_name = class_path.partition(":")
        scorer = getattr(importlib.import_module(module_name), class_name)(**kwargs)
    return scorer.to(device)


def arg_value(text: str) -> object:
    """A --arg value: a Python literal (95, 0.5, True) when it parses as one, else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--scorer", choices=[n for n in SCORER_NAMES if n != "remote"], help="a registered scorer")
    which.add_argument("--scorer-class", help="module:Class of a Scorer (rewards/base.py) to import")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="a constructor argument")
    parser.add_argument("--device", default="cpu", help="where the scorer runs (cpu, cuda:0, ...)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-mb", type=float, default=256.0, help="largest request body, in MiB")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bad = [a for a in args.arg if "=" not in a]
    if bad:
        raise SystemExit(f"--arg must be KEY=VALUE, got {bad[0]!r}")
    kwargs = {key: arg_value(value) for key, value in (a.split("=", 1) for a in args.arg)}
    scorer = load_scorer(args.scorer, args.scorer_class, kwargs, args.device)
    app = make_app(scorer, max_bytes=int(args.max_mb * 2**20), token=os.environ.get(TOKEN_ENV) or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
