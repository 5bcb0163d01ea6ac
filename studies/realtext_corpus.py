"""A real-text corpus that exists on any machine with kvpop installed: the source code and documentation
of a fixed list of installed third-party packages, as byte-level token ids.

::

    python -m studies.realtext_corpus --out kvpop/data/realtext            # validation + test + manifest
    python -m studies.realtext_corpus --out runs/realtext --splits train,validation,test

What it does, deterministically for a given ``--seed``, package list and installed package versions:

* **Files.**  Every file with a text suffix (:data:`SUFFIXES`) under each package's directory in
  ``site-packages`` (``--site-packages``, default this interpreter's ``purelib``), in sorted order.
  The Python standard library is never read: a file must lie, after resolving links, under the
  ``site-packages`` directory given, and a file byte-identical to any file of the standard library
  (``--stdlib``, default ``sysconfig``'s ``stdlib``; vendored copies) is dropped.  A file that is not
  UTF-8 text, holds a NUL byte, or is shorter than :data:`MIN_FILE_BYTES` is dropped.
* **Splits by file.**  Each file goes to ``train``, ``validation`` or ``test`` by a seeded BLAKE2 hash of
  ``"<seed>:<package>/<relative path>"`` (:func:`split_of`; ``--valid-frac``/``--test-frac``), so no
  file contributes to two splits.
* **Tokens.**  Bytes are ids ``0..255``; :data:`BOS_ID` (256) opens every file, :data:`EOS_ID` (257)
  closes it; :data:`PAD_ID` (258) is never written; :data:`VOCAB_SIZE` = 260.  No tokenizer is needed.
* **Records.**  Each file's stream ``[BOS] + bytes + [EOS]`` is cut into consecutive pieces of exactly
  ``--seq-len`` (1024) tokens (a shorter tail is dropped), at most ``--max-records-per-file`` per file
  (the first ones), so one large file cannot fill a split.  Files are taken in the order of their hash
  until the split holds its ``--max-records`` (``--max-train-records`` for train).  Each split is a JSONL
  file of ``{"input_ids": [...]}`` records (:mod:`kvpop.training.data` reads it; ``kvpop train --data``,
  ``kvpop eval --data``, ``kvpop pretrain --data``).
* **Manifest.**  ``manifest.json`` records the command settings, the package versions, per split the
  files used (a hash of their sorted list, their count and bytes), the record count and the BLAKE2 hash of
  the JSONL file, so a regenerated corpus can be checked against the shipped one
  (:func:`check_split`).  A corpus regenerated on a machine with other package versions differs; the
  manifest says which versions made it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from .paths import DATA, check_out_dir

__all__ = ["PACKAGES", "SUFFIXES", "BOS_ID", "EOS_ID", "PAD_ID", "VOCAB_SIZE", "SPLITS", "split_of",
           "list_files", "file_records", "build", "check_split", "file_hash", "main"]

PACKAGES = ("transformers", "numpy", "triton", "_pytest", "safetensors", "tqdm", "matplotlib", "hypothesis")
"""Import directories read (kvpop's own dependencies and test tools, all in CI's clean install; ``_pytest`` is
pytest's code, its ``pytest`` directory being a shim).  torch is left out: it is large and mostly binary."""
DISTRIBUTIONS = {"_pytest": "pytest"}
"""Import directory -> distribution name, where they differ (for the version in the manifest)."""
SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 260
SPLITS = ("train", "validation", "test")
MIN_FILE_BYTES = 256
SHIPPED_DIR = DATA / "realtext"
"""Where the shipped validation and test splits and their manifest live."""


def file_hash(path: str | os.PathLike) -> str:
    """BLAKE2b-128 hex digest of a file's bytes."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _unit(seed: int, key: str) -> float:
    d = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "big") / 2.0**64


def split_of(key: str, seed: int = 0, valid_frac: float = 0.05, test_frac: float = 0.05) -> str:
    """The split of the file named ``key`` (``"<package>/<relative path>"``): ``validation`` when its seeded
    hash in [0, 1) is below ``valid_frac``, ``test`` below ``valid_frac + test_frac``, else ``train``."""
    u = _unit(seed, key)
    if u < valid_frac:
        return "validation"
    if u < valid_frac + test_frac:
        return "test"
    return "train"


def _stdlib_hashes(stdlib: Path | None, site: Path) -> set[str]:
    """Content hashes of the standard library's text files (``site-packages`` inside it is skipped)."""
    if stdlib is None or not stdlib.is_dir():
        return set()
    out = set()
    for root, dirs, files in os.walk(stdlib):
        r = Path(root)
        dirs[:] = sorted(d for d in dirs if d != "site-packages" and (r / d).resolve() != site)
        for f in files:
            if f.endswith(SUFFIXES):
                try:
                    out.add(file_hash(r / f))
                except OSError:
                    pass
    return out


def list_files(site: Path, packages: Sequence[str], *, stdlib: Path | None = None) -> list[tuple[str, Path]]:
    """``(key, path)`` of every text file of ``packages`` under ``site`` (sorted by key; see the module
    docstring for what is dropped).  ValueError when a package directory is missing."""
    site = site.resolve()
    std = _stdlib_hashes(stdlib.resolve() if stdlib is not None else None, site)
    out = []
    for pkg in packages:
        root = site / pkg
        if not root.is_dir():
            raise ValueError(f"package directory {root} does not exist; installed packages under {site} are "
                             f"needed (give --packages with ones that are installed, or --site-packages)")
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                p = Path(dirpath) / f
                if not f.endswith(SUFFIXES) or not p.is_file():
                    continue
                real = p.resolve()
                if site not in real.parents:  # a link out of site-packages (e.g. into the standard library)
                    continue
                out.append((f"{pkg}/{p.relative_to(root).as_posix()}", p))
    if std:
        out = [(k, p) for k, p in out if file_hash(p) not in std]
    return sorted(out)


def _text_bytes(path: Path) -> bytes | None:
    data = path.read_bytes()
    if len(data) < MIN_FILE_BYTES or b"\0" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def file_records(data: bytes, seq_len: int, max_records: int) -> list[list[int]]:
    """The records of one file: ``[BOS] + bytes + [EOS]`` cut into ``seq_len`` pieces (tail dropped), the
    first ``max_records``."""
    stream = [BOS_ID, *data, EOS_ID]
    n = min(len(stream) // seq_len, max_records)
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(n)]


def _versions(packages: Iterable[str], site: Path | None = None) -> dict[str, str]:
    """Each package's distribution version: as installed in ``site`` when given (the directory the files were
    read from: its ``*.dist-info``; "unknown" when it holds none for a package), else as this interpreter has it."""
    from importlib import metadata

    found = None
    if site is not None:
        found = {}
        for d in metadata.distributions(path=[str(site)]):
            found.setdefault((d.metadata["Name"] or "").lower().replace("-", "_"), d.version)
    out = {}
    for pkg in packages:
        dist = DISTRIBUTIONS.get(pkg, pkg)
        if found is not None:
            out[dist] = found.get(dist.lower().replace("-", "_"), "unknown")
            continue
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def build(out: str | os.PathLike, *, site: str | os.PathLike | None = None, stdlib: str | os.PathLike | None = None,
          packages: Sequence[str] = PACKAGES, splits: Sequence[str] = ("validation", "test"), seed: int = 0,
          seq_len: int = 1024, max_records: int = 64, max_train_records: int = 8000,
          max_records_per_file: int = 2, valid_frac: float = 0.05, test_frac: float = 0.05,
          command: str | None = None) -> dict:
    """Write ``OUT/<split>.jsonl`` for each of ``splits`` and ``OUT/manifest.json``; returns the manifest.
    ValueError (before anything is written) when a split would hold no record."""
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise ValueError(f"splits must be among {list(SPLITS)}, got {list(splits)}")
    for name, v, low in (("seq_len", seq_len, 2), ("max_records", max_records, 1),
                         ("max_train_records", max_train_records, 1),
                         ("max_records_per_file", max_records_per_file, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if not (0 < valid_frac and 0 < test_frac and valid_frac + test_frac < 1):
        raise ValueError(f"valid_frac and test_frac must be > 0 with a sum < 1, got {valid_frac}, {test_frac}")
    site_given = site is not None
    site = Path(site if site is not None else sysconfig.get_paths()["purelib"])
    std = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"]) if stdlib != "" else None
    t0 = time.time()
    files = list_files(site, packages, stdlib=std)
    by_split: dict[str, list[tuple[str, Path]]] = {s: [] for s in SPLITS}
    for key, p in files:
        by_split[split_of(key, seed, valid_frac, test_frac)].append((key, p))
    chosen: dict[str, tuple[list[list[int]], list[str], int]] = {}
    for split in splits:  # every split's records first: a split without one is refused before anything is written
        cap = max_train_records if split == "train" else max_records
        order = sorted(by_split[split], key=lambda kp: (_unit(seed + 1, kp[0]), kp[0]))
        records: list[list[int]] = []
        used: list[str] = []
        nbytes = 0
        for key, p in order:
            if len(records) >= cap:
                break
            data = _text_bytes(p)
            if data is None:
                continue
            recs = file_records(data, seq_len, min(max_records_per_file, cap - len(records)))
            if recs:
                records.extend(recs)
                used.append(key)
                nbytes += len(data)
        if not records:
            raise ValueError(f"split {split!r} would hold no records: none of its {len(by_split[split])} file(s) (of "
                             f"{len(files)} listed) is UTF-8 text of at least {MIN_FILE_BYTES} bytes giving a record "
                             f"of --seq-len {seq_len} tokens; give more --packages, a smaller --seq-len, or a larger "
                             f"--valid-frac / --test-frac")
        chosen[split] = (records, used, nbytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": 'JSONL, one {"input_ids": [...]} of exactly seq_len byte-level ids per line',
        "command": command,
        "settings": {"packages": list(packages), "suffixes": list(SUFFIXES), "seed": seed, "seq_len": seq_len,
                     "max_records": max_records, "max_train_records": max_train_records,
                     "max_records_per_file": max_records_per_file, "valid_frac": valid_frac, "test_frac": test_frac,
                     "min_file_bytes": MIN_FILE_BYTES},
        "vocab": {"bytes": "0..255", "bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID, "vocab_size": VOCAB_SIZE},
        "package_versions": _versions(packages, site if site_given else None),
        "python": sys.version.split()[0],
        "files_listed": {s: len(v) for s, v in by_split.items()},
        "splits": {},
    }
    for split in splits:
        records, used, nbytes = chosen.pop(split)
        path = out / f"{split}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps({"input_ids": r}, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        listing = "\n".join(sorted(used)).encode()
        manifest["splits"][split] = {
            "file": path.name, "records": len(records), "tokens": len(records) * seq_len, "files_used": len(used),
            "files_used_bytes": nbytes, "files_used_hash": hashlib.blake2b(listing, digest_size=16).hexdigest(),
            "files_per_package": {pkg: sum(1 for k in used if k.split("/", 1)[0] == pkg) for pkg in packages},
            "jsonl_blake2b": file_hash(path)}
        if split != "train":
            manifest["splits"][split]["files"] = sorted(used)
    manifest["build_seconds"] = round(time.time() - t0, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_split(directory: str | os.PathLike, split: str) -> Path:
    """The path of ``DIR/<split>.jsonl`` after checking it against ``DIR/manifest.json`` (hash and record
    count); ValueError naming what differs."""
    d = Path(directory)
    man = json.loads((d / "manifest.json").read_text())
    if split not in man["splits"]:
        raise ValueError(f"{d}/manifest.json has no split {split!r}; it has {sorted(man['splits'])}")
    entry = man["splits"][split]
    path = d / entry["file"]
    if not path.is_file():
        raise ValueError(f"{path} is missing; regenerate it with python -m studies.realtext_corpus "
                         f"(settings in {d}/manifest.json)")
    got = file_hash(path)
    if got != entry["jsonl_blake2b"]:
        raise ValueError(f"{path} has hash {got}, its manifest says {entry['jsonl_blake2b']}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.realtext_corpus",
                                description="byte-level corpus of installed packages' source and documentation")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--splits", default="validation,test", help="comma-separated among train,validation,test")
    p.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated import directories")
    p.add_argument("--site-packages", default=None, help="default: this interpreter's purelib")
    p.add_argument("--stdlib", default=None, help="standard library directory whose files are excluded "
                   "(default: this interpreter's); '' to skip the content check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-records", type=int, default=64, help="records per validation / test split")
    p.add_argument("--max-train-records", type=int, default=8000)
    p.add_argument("--max-records-per-file", type=int, default=2)
    p.add_argument("--valid-frac", type=float, default=0.05)
    p.add_argument("--test-frac", type=float, default=0.05)
    p.add_argument("--write-shipped", action="store_true",
                   help=f"allow --out to be in what the project ships (the shipped corpus is {SHIPPED_DIR})")
    a = p.parse_args(argv)
    try:
        check_out_dir(a.out, write_shipped=a.write_shipped)
        man = build(a.out, site=a.site_packages, stdlib=a.stdlib,
                    packages=[x for x in a.packages.split(",") if x], splits=[x for x in a.splits.split(",") if x],
                    seed=a.seed, seq_len=a.seq_len, max_records=a.max_records,
                    max_train_records=a.max_train_records, max_records_per_file=a.max_records_per_file,
                    valid_frac=a.valid_frac, test_frac=a.test_frac,
                    command="python -m studies.realtext_corpus "
                    + " ".join(sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError) as e:
        print(f"realtext_corpus: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({s: {k: v[k] for k in ("records", "files_used")} for s, v in man["splits"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
