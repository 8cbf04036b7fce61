"""Offline data commands of ``dilocox-ctl`` (no node is contacted):

* ``dilocox-ctl tokenizer train CORPUS --vocab-size N -o tokenizer.json``: a byte-level BPE
  (dilocox/tokenizer.py) trained on a data spec's documents;
* ``dilocox-ctl data prepare SPEC --tokenizer T -o DIR``: token shards plus an index that nodes read by memmap
  (dilocox/shards.py; ``--data DIR``);
* ``dilocox-ctl export CHECKPOINT_DIR... --hf OUT``: a Hugging Face model of theta (dilocox/export.py).

Exit codes: 0 done, 2 bad input (named on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parsers(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True, metavar="{train}")
    p = tsub.add_parser("train", help="write a Hugging Face tokenizer.json trained on CORPUS")
    p.add_argument("corpus", metavar="CORPUS", help="a data spec: text file, .jsonl(.gz), a folder of them, or "
                                                    "builtin:shakespeare")
    p.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (>= 258)")
    p.add_argument("--text-field", default="text", help="the field holding a document's text in .jsonl data")
    p.add_argument("-o", "--out", required=True, metavar="tokenizer.json")
    p = sub.add_parser("data", help="prepare token shards that nodes read by memmap")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="{prepare}")
    p = dsub.add_parser("prepare", help="tokenize SPEC into DIR (shards and index.json; --data DIR on the nodes)")
    p.add_argument("spec", metavar="SPEC", help="a data spec: text file, .jsonl(.gz), a folder of them, or "
                                                "builtin:shakespeare")
    p.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer.json (or a folder holding one)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of units held out for validation")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file at most")
    p.add_argument("-o", "--out", required=True, metavar="DIR")
    p = sub.add_parser("export", help="write a Hugging Face model (config.json, model.safetensors, tokenizer) of "
                                      "theta from node checkpoints")
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT_DIR",
                   help="a node's --checkpoint-dir; for pipeline stages one per stage")
    p.add_argument("--hf", required=True, metavar="OUT", help="folder to write")
    p.add_argument("--tokenizer", default=None, help="the tokenizer.json the model was trained with, where the "
                                                     "path in the checkpoint no longer holds it")


def run(args: argparse.Namespace) -> int:
    from dilocox.data import DataError, iter_documents
    from dilocox.export import ExportError, export_hf
    from dilocox.shards import ShardError, prepare
    from dilocox.tokenizer import TokenizerError, describe, load_tokenizer, train_bpe

    try:
        if args.command == "export":
            out = export_hf([Path(d) for d in args.checkpoints], Path(args.hf), args.tokenizer)
            print(f"wrote {out}: config.json, model.safetensors, tokenizer.json (transformers: "
                  f"AutoModelForCausalLM.from_pretrained({str(out)!r}))")
            return 0
        if args.command == "tokenizer":
            tok = train_bpe(iter_documents(args.corpus, args.text_field), args.vocab_size, Path(args.out))
            print(f"wrote {args.out}: {describe(tok)}")
            return 0
        if not 0 < args.val_fraction <= 0.5:
            raise DataError(f"--val-fraction {args.val_fraction}: need 0 < f <= 0.5")
        if args.shard_tokens < 1:
            raise DataError(f"--shard-tokens {args.shard_tokens}: need at least 1")
        tok = load_tokenizer(args.tokenizer)
        began = time.monotonic()

        def progress(units: int, tokens: int) -> None:
            print(f"\r{units} units, {tokens:,} tokens, {time.monotonic() - began:.0f} s", end="", file=sys.stderr)

        index = prepare(iter_documents(args.spec, args.text_field), tok, Path(args.out), source=args.spec,
                        val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, progress=progress)
        print(file=sys.stderr)
        sp = index["splits"]
        print(f"wrote {args.out}: {sp['train']['tokens']:,} train and {sp['val']['tokens']:,} validation tokens "
              f"({index['dtype']}, {len(sp['train']['shards'])} + {len(sp['val']['shards'])} shards; "
              f"{sp['train']['bytes'] / max(1, sp['train']['tokens']):.2f} bytes per token), {describe(tok)}")
        return 0
    except (DataError, ShardError, TokenizerError, ExportError, OSError) as e:
        print(f"dilocox-ctl: {e}", file=sys.stderr)
        return 2
