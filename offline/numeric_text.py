"""
Numeric-rich training text, written by this project: documents dense in random identifiers, for the
gates' training beside the prose corpus of offline/fetch_assets.py (Wikipedia leads, State of the
Union addresses, the Python reference), which holds few of them. The KVzip teacher keeps the tokens
a repeat of the context cannot guess, random digits above all; a gate that saw few of them in
training keeps fewer than its teacher does (kvpress's KVzap, NVIDIA/kvpress:kvzap/data.py, trains
on a mix with math and code subsets for the same reason).

Six kinds of section, each written from a seeded random.Random with identifiers drawn afresh:
    kv      key-value records: asset registers, JSON lines, order records
    log     service logs: ISO timestamps, hosts, IP addresses, request ids, status codes, latencies
    table   CSV, pipe and fixed-width tables: rows of ids, dates, counts and amounts
    config  INI, YAML and TOML files and environment files: ports, hashes, paths, versions
    code    Python, C and SQL snippets: hex constants, numeric limits, UUIDs, register maps
    prose   incident reports, shipping notes, lab notebooks and change notes naming such ids
A document is mostly of one kind (document i: KINDS[i % 6], so every kind is present), with
sections of other kinds mixed in as real files hold them (a report quoting its log), until it
reaches a length drawn from DOC_CHARS. Each identifier a section names is, with probability REUSE,
one the document named before (a request id in several log lines, an order in the table and the
report), else a new draw. Documents are independent, each from a generator of its own seeded by
(VERSION, seed, index): document i of seed S is the same text whichever others exist, so a run
resumes, and `--docs` can grow a corpus. Another seed is another corpus in the same formats: the
held-out set (--seed 2 beside --seed 1 for training) measures new identifiers in known formats,
not new formats (as do the held-out documents train_gate.py's --val-docs takes from one seed's).

None of it comes from the benchmark: no sentence, name or word list of harness/quality.py,
harness/decode.py or harness/ruler_tasks.py (tests/test_numeric_text.py checks the shingles).

    python -m offline.numeric_text --out ~/.cache/numeric-train --docs 20 --seed 1
    python -m offline.numeric_text --out ~/.cache/numeric-heldout --docs 6 --seed 2
    python train_gate.py --steps 0 --data ~/.cache/numeric-train --out out/numeric ...

Each document is written atomically as NNNNN-<kind>.txt; a rerun keeps the documents already
written (after checking that each is this seed's) and writes the rest; a file that is not this
generator's is never overwritten.
"""
import argparse
import json
import random
import re
import string
import sys
from pathlib import Path

KINDS = ("kv", "log", "table", "config", "code", "prose")
DOC_CHARS = (3_500, 9_000)  # a document's length: ~2K-6K tokens (CHARS_PER_TOKEN)
# the summary's estimate: Gemma 3's and SmolLM2's tokenizers give 1.5 characters per token on this
# text (every digit is a token of its own; 1.3 in the densest tables)
CHARS_PER_TOKEN = 1.5
OWN_KIND = 0.6  # the share of a document's later sections of its own kind
REUSE = 0.3     # how often a section takes an identifier the document already used
VERSION = 1     # of the generator's output: a corpus of another version is refused, not mixed
RECORD = "numeric_text.json"  # in --out: the seed and version its documents were written with
NAME = re.compile(r"^\d{5}-(%s)\.txt$" % "|".join(KINDS))

# word lists of our own (none is the benchmark's: tests/test_numeric_text.py)
SERVICES = ("billing", "ingest", "auth", "search", "thumbnailer", "scheduler", "gateway", "ledger",
            "mailer", "indexer", "uploader", "metrics", "reports", "checkout", "catalog", "sync")
ROLES = ("web", "db", "cache", "worker", "edge", "queue", "store", "api")
SITES = ("fra", "ams", "iad", "sjc", "nrt", "syd", "gru", "lhr", "ord", "sin")
GIVEN = ("Ana", "Bilal", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi",
         "Lena", "Mateo", "Nadia", "Omar", "Priya", "Rafael", "Sanne", "Tomas", "Uma", "Viktor",
         "Wen", "Yara", "Zoltan")
FAMILY = ("Okafor", "Haddad", "Novak", "Tanaka", "Silva", "Kowalski", "Mensah", "Ivanova",
          "Larsen", "Moreau", "Costa", "Nguyen", "Petrov", "Rahman", "Schmidt", "Virtanen",
          "Yilmaz", "Zhou", "Andersen", "Bauer")
GOODS = ("steel brackets", "copper wire", "resin pellets", "glass vials", "cable ties",
         "ball bearings", "filter cartridges", "pump seals", "circuit boards", "hex bolts",
         "paper rolls", "solvent drums", "fan motors", "sensor modules")
CITIES = ("Rotterdam", "Gdansk", "Valencia", "Porto", "Tampere", "Lyon", "Graz", "Brno", "Aarhus",
          "Bilbao", "Leipzig", "Turin", "Ghent", "Malmo")
UNITS = ("mg", "mL", "nm", "kPa", "rpm", "mA", "K", "s", "ms", "kg")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")
STATUS = (200, 200, 200, 200, 201, 204, 301, 304, 400, 401, 403, 404, 409, 429, 500, 502, 503)
LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
FULL_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
               "September", "October", "November", "December")


# -------------------------------------------------------------------------------------------------
# identifiers: each a fresh draw, or (pick) one this document drew before

class Ids:
    """The random identifiers of one document, drawn from its rng; `pick(kind)` returns one already
    drawn of that kind with probability REUSE, so that ids recur within a document."""

    def __init__(self, rng):
        self.rng, self.seen = rng, {}

    def pick(self, kind):
        seen = self.seen.setdefault(kind, [])
        if seen and self.rng.random() < REUSE:
            return self.rng.choice(seen)
        value = getattr(self, kind)()
        seen.append(value)
        return value

    def digits(self, n):
        r = self.rng
        return str(r.randint(1, 9)) + "".join(r.choice(string.digits) for _ in range(n - 1))

    def hexs(self, n):
        return "".join(self.rng.choice("0123456789abcdef") for _ in range(n))

    def uuid(self):
        h = self.hexs(32)
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{self.rng.choice('89ab')}{h[17:20]}-{h[20:]}"

    def ip(self):
        r = self.rng
        return f"10.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(1, 254)}"

    def host(self):
        r = self.rng
        return f"{r.choice(ROLES)}-{r.randint(1, 48):02d}.{r.choice(SITES)}{r.randint(1, 4)}"

    def port(self):
        return str(self.rng.choice((self.rng.randint(1024, 9999), self.rng.randint(10000, 65535))))

    def request(self):
        return self.hexs(self.rng.choice((8, 12, 16)))

    def order(self):
        return self.digits(self.rng.randint(5, 8))

    def part(self):
        r = self.rng
        letters = "".join(r.choice(string.ascii_uppercase) for _ in range(r.randint(2, 3)))
        return f"{letters}-{self.digits(r.randint(3, 5))}" + (f"-{r.randint(1, 99):02d}"
                                                              if r.random() < 0.4 else "")

    def person(self):
        return f"{self.rng.choice(GIVEN)} {self.rng.choice(FAMILY)}"

    def user(self):
        r = self.rng
        return f"{r.choice(GIVEN).lower()}.{r.choice(FAMILY).lower()}{r.randint(1, 999)}"

    def sha(self):
        return self.hexs(self.rng.choice((12, 40, 64)))

    def version(self):
        r = self.rng
        return f"{r.randint(0, 14)}.{r.randint(0, 40)}.{r.randint(0, 120)}"

    def path(self):
        r = self.rng
        return "/" + "/".join([r.choice(("srv", "var", "opt", "data", "home")), r.choice(SERVICES),
                               f"{r.choice(('v', 'run', 'shard', 'lot'))}{r.randint(1, 9999)}"])

    def date(self):
        r = self.rng
        return f"{r.randint(2009, 2031)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"

    def time(self):
        r = self.rng
        return f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}"

    def amount(self):
        return f"{self.rng.randint(1, 99999)}.{self.rng.randint(0, 99):02d}"

    def serial(self):
        r = self.rng
        letters = "".join(r.choice(string.ascii_uppercase) for _ in range(2))
        return f"{letters}{self.digits(7)}"

    def phone(self):
        return f"+{self.rng.randint(30, 49)} {self.digits(3)} {self.digits(4)} {self.digits(3)}"


# -------------------------------------------------------------------------------------------------
# sections, one function per kind: (rng, ids) -> text

def kv_section(r, ids):
    style = r.randrange(3)
    if style == 0:  # an asset register
        lines = [f"# asset register, site {r.choice(CITIES)}, exported {ids.pick('date')}"]
        for _ in range(r.randint(8, 20)):
            lines.append(f"asset {ids.pick('part')}: serial={ids.pick('serial')} "
                         f"host={ids.pick('host')} ip={ids.pick('ip')} "
                         f"rack={r.randint(1, 60)} slot={r.randint(1, 42)} "
                         f"since={ids.pick('date')}")
        return "\n".join(lines)
    if style == 1:  # JSON lines
        lines = []
        for _ in range(r.randint(8, 18)):
            rec = {"order": int(ids.pick("order")), "part": ids.pick("part"),
                   "qty": r.randint(1, 500), "price": float(ids.amount()),
                   "placed": f"{ids.pick('date')}T{ids.pick('time')}Z", "ref": ids.pick("request")}
            lines.append(json.dumps(rec))
        return "\n".join(lines)
    lines = [f"Record {ids.pick('order')}"]  # a key: value record dump
    for _ in range(r.randint(3, 6)):
        lines += ["---", f"id: {ids.pick('uuid')}", f"owner: {ids.pick('user')}",
                  f"created: {ids.pick('date')} {ids.pick('time')}",
                  f"size_bytes: {ids.digits(r.randint(4, 10))}",
                  f"checksum: {ids.pick('sha')}", f"location: {ids.pick('path')}"]
    return "\n".join(lines)


def log_section(r, ids):
    style, lines = r.randrange(3), []
    date, n = ids.pick("date"), r.randint(12, 30)
    h, m, s = r.randint(0, 22), r.randint(0, 59), r.randint(0, 59)
    for _ in range(n):
        s += r.randint(0, 40)
        m, s = m + s // 60, s % 60
        h, m = h + m // 60, m % 60
        stamp, status = f"{h % 24:02d}:{m:02d}:{s:02d}", r.choice(STATUS)
        if style == 0:  # key=value lines
            lines.append(f"{date}T{stamp}.{r.randint(0, 999):03d}Z {r.choice(LEVELS)} "
                         f"host={ids.pick('host')} svc={r.choice(SERVICES)} "
                         f"req={ids.pick('request')} status={status} "
                         f"latency_ms={r.randint(1, 4000)} bytes={r.randint(0, 900000)}")
        elif style == 1:  # an access log
            y, mo, d = date.split("-")
            lines.append(f'{ids.pick("ip")} - {ids.pick("user")} [{d}/{MONTHS[int(mo) - 1]}/{y}:'
                         f'{stamp} +0000] "{r.choice(METHODS)} /api/v{r.randint(1, 4)}/'
                         f'{r.choice(SERVICES)}/{ids.pick("order")} HTTP/1.1" {status} '
                         f'{r.randint(0, 90000)} {r.randint(1, 3000)}ms')
        else:  # syslog
            y, mo, d = date.split("-")
            proc = r.choice(("postgres", "nginx", "kernel", "sshd", "cron", "dockerd"))
            event = r.choice((f"checkpoint complete: wrote {r.randint(10, 9000)} buffers",
                              f"accepted key for {ids.pick('user')} from {ids.pick('ip')} "
                              f"port {ids.pick('port')}",
                              f"upstream {ids.pick('ip')}:{ids.pick('port')} timed out after "
                              f"{r.randint(1, 120)} s",
                              f"job {ids.pick('order')} exited with code {r.randint(0, 255)}",
                              f"container {ids.hexs(12)} restarted ({r.randint(1, 40)} times)"))
            lines.append(f"{MONTHS[int(mo) - 1]} {int(d):2d} {stamp} {ids.pick('host')} "
                         f"{proc}[{r.randint(100, 65000)}]: {event}")
    return "\n".join(lines)


def table_section(r, ids):
    style, n = r.randrange(3), r.randint(8, 22)
    rows = []
    for _ in range(n):
        qty, price = r.randint(1, 900), float(ids.amount()) / 10
        rows.append((ids.pick("order"), ids.pick("date"), ids.pick("part"), r.choice(CITIES), qty,
                     f"{price:.2f}", f"{qty * price:.2f}"))
    head = ("order", "date", "part", "city", "qty", "unit_price", "total")
    if style == 0:  # CSV
        return "\n".join(",".join(map(str, row)) for row in [head, *rows])
    if style == 1:  # a pipe table with a total row
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        total = sum(float(row[-1]) for row in rows)
        return "\n".join(lines + [f"| total | | | | {sum(row[4] for row in rows)} | | "
                                  f"{total:.2f} |"])
    widths = (10, 11, 14, 10, 5, 11, 12)  # a fixed-width report
    fmt = lambda row: "".join(f"{str(x):<{w}}" for x, w in zip(row, widths)).rstrip()
    return "\n".join([f"Report {ids.pick('serial')}, printed {ids.pick('date')}", fmt(head),
                      *map(fmt, rows)])


def config_section(r, ids):
    svc, style = r.choice(SERVICES), r.randrange(4)
    if style == 0:  # INI
        return "\n".join([f"[{svc}]", f"listen = {ids.pick('ip')}:{ids.pick('port')}",
                          f"workers = {r.randint(1, 64)}", f"timeout_s = {r.randint(1, 600)}",
                          f"data_dir = {ids.pick('path')}", "", "[upstream]",
                          f"primary = {ids.pick('host')}:{ids.pick('port')}",
                          f"secondary = {ids.pick('host')}:{ids.pick('port')}",
                          f"retries = {r.randint(0, 9)}", f"token_sha = {ids.pick('sha')}"])
    if style == 1:  # YAML
        lines = ["services:"]
        for _ in range(r.randint(2, 4)):
            lines += [f"  {r.choice(SERVICES)}:",
                      f"    image: registry.internal:{ids.pick('port')}/{svc}:"
                      f"{ids.pick('version')}",
                      f"    digest: sha256:{ids.hexs(64)}",
                      f"    ports: [\"{ids.pick('port')}:{ids.pick('port')}\"]",
                      f"    memory_mb: {r.choice((256, 512, 1024, 2048, 4096))}",
                      f"    replicas: {r.randint(1, 12)}",
                      f"    volume: {ids.pick('path')}"]
        return "\n".join(lines)
    if style == 2:  # TOML
        return "\n".join([f"[{svc}.database]", f'host = "{ids.pick("ip")}"',
                          f"port = {ids.pick('port')}", f'name = "{svc}_{ids.digits(4)}"',
                          f"pool_size = {r.randint(2, 80)}", "", f"[{svc}.release]",
                          f'version = "{ids.pick("version")}"', f'commit = "{ids.hexs(40)}"',
                          f'built = "{ids.pick("date")}T{ids.pick("time")}Z"',
                          f'build_id = "{ids.pick("uuid")}"'])
    return "\n".join([f"{svc.upper()}_{k}={v}" for k, v in (  # an environment file
        ("HOST", ids.pick("host")), ("PORT", ids.pick("port")), ("SECRET_ID", ids.pick("uuid")),
        ("MAX_BODY", ids.digits(r.randint(5, 8))), ("CACHE_TTL", r.randint(30, 86400)),
        ("SEED", ids.digits(r.randint(6, 10))), ("KEY_SHA", ids.pick("sha")))])


def code_section(r, ids):
    style = r.randrange(3)
    if style == 0:  # Python
        name = r.choice(SERVICES)
        codes = [f"    {r.randint(1000, 9999)}: \"{r.choice(SERVICES)} "
                 f"{r.choice(('down', 'slow', 'full'))}\"," for _ in range(r.randint(3, 7))]
        delays = ", ".join(str(r.randint(5, 9000)) for _ in range(5))
        return "\n".join([f"# {name}/constants.py, rev {ids.hexs(7)}",
                          f"CRC_POLY = 0x{ids.hexs(8).upper()}",
                          f"MAX_FRAME = {r.randint(512, 65536)}",
                          f"RETRY_DELAYS_MS = ({delays})",
                          f"NAMESPACE = \"{ids.pick('uuid')}\"",
                          "ERRORS = {", *codes, "}", "", "",
                          "def frame_ok(buf, seq):",
                          f"    if len(buf) > MAX_FRAME or seq % {r.randint(3, 97)} == "
                          f"{r.randint(0, 2)}:",
                          "        return False",
                          f"    return crc32(buf, CRC_POLY) == 0x{ids.hexs(8)}"])
    if style == 1:  # C register map
        base = r.randint(0x1000, 0xFFFF) << 16
        names = [f"REG_{r.choice(('CTRL', 'STAT', 'DATA', 'IRQ', 'DMA', 'CLK'))}{i}"
                 for i in range(r.randint(4, 9))]
        regs = [f"#define {name} (0x{base:08X}u + 0x{4 * i + r.randint(0, 3) * 0x100:03X}u)"
                for i, name in enumerate(names)]
        table = ", ".join(f"0x{ids.hexs(2)}" for _ in range(r.randint(12, 32)))
        return "\n".join([f"/* generated {ids.pick('date')}, board {ids.pick('serial')} */", *regs,
                          f"#define FW_MAGIC 0x{ids.hexs(8).upper()}u",
                          f"#define BAUD {r.choice((9600, 57600, 115200, 921600))}",
                          f"static const uint8_t lut[] = {{{table}}};",
                          f"int init(void) {{ return write_reg({names[0]}, {r.randint(1, 255)}); "
                          "}"])
    rows = [f"({ids.pick('order')}, '{ids.pick('part')}', {r.randint(1, 400)}, "  # SQL
            f"{ids.amount()}, '{ids.pick('date')}')" for _ in range(r.randint(6, 14))]
    return (f"-- migration {ids.digits(14)}\nINSERT INTO orders (id, part, qty, price, placed) "
            f"VALUES\n  " + ",\n  ".join(rows) + ";\n"
            f"UPDATE orders SET status = {r.randint(1, 9)} WHERE id = {ids.pick('order')};")


def prose_section(r, ids):
    """A paragraph of sentences, each from one of our templates with identifiers in it."""
    d, t, who = lambda: ids.pick("date"), lambda: ids.pick("time"), lambda: ids.pick("person")
    say = (
        lambda: f"At {t()} UTC on {d()}, {ids.pick('host')} ({ids.pick('ip')}) stopped answering "
                f"on port {ids.pick('port')}.",
        lambda: f"Request {ids.pick('request')} was the first to fail, after "
                f"{r.randint(2, 90)} seconds.",
        lambda: f"{who()} rolled {r.choice(SERVICES)} back to version {ids.pick('version')} "
                f"at {t()}.",
        lambda: f"Consignment {ids.pick('order')} left {r.choice(CITIES)} with {r.randint(2, 80)} "
                f"pallets of {r.choice(GOODS)} ({r.randint(100, 30000)} kg).",
        lambda: f"The invoice {ids.pick('serial')} for {ids.amount()} EUR was paid on {d()}.",
        lambda: f"Part {ids.part()} replaces {ids.pick('part')} from batch "
                f"{ids.digits(r.randint(4, 6))} onwards.",
        lambda: f"Sample {ids.pick('part')} was diluted 1:{r.choice((10, 50, 250, 1000))} and read "
                f"{r.randint(200, 900)}.{r.randint(0, 9)} {r.choice(UNITS)} at {t()}.",
        lambda: f"Run {ids.digits(r.randint(4, 7))} gave {r.randint(0, 999)}."
                f"{r.randint(0, 999):03d} "
                f"{r.choice(UNITS)} against {r.randint(0, 999)}.{r.randint(0, 99):02d} in run "
                f"{ids.digits(r.randint(4, 7))}.",
        lambda: f"{who()} can be reached at {ids.pick('phone')} until {d()}.",
        lambda: f"Commit {ids.hexs(r.choice((7, 10, 40)))} by {ids.pick('user')} fixed the "
                f"overflow at offset 0x{ids.hexs(r.choice((4, 6)))}.",
        lambda: f"Build {ids.pick('uuid')} took {r.randint(40, 3000)} s on {ids.pick('host')}.",
        lambda: f"In {r.choice(FULL_MONTHS)} {r.randint(2009, 2031)} the warehouse in "
                f"{r.choice(CITIES)} shipped {r.randint(1000, 99999)} units, "
                f"{r.randint(1, 99)}.{r.randint(0, 9)}% more than a year before.",
        lambda: f"The disk at {ids.pick('path')} filled up at {t()}, "
                f"{ids.digits(r.randint(9, 12))} "
                f"bytes in all.",
        lambda: f"Order {ids.pick('order')} ({r.randint(1, 60)} x {ids.pick('part')}) waits for "
                f"customs form {ids.pick('serial')}.",
        lambda: f"Between {t()} and {t()} the queue on {ids.pick('host')} held "
                f"{r.randint(100, 990000)} messages.",
        lambda: f"{who()} signed off the change {ids.pick('request')} on {d()}.",
        lambda: f"The checksum of {ids.pick('path')} is {ids.pick('sha')}, as published.",
        lambda: f"Please quote {ids.pick('serial')} and {ids.pick('order')} in every reply.",
        lambda: f"The pump on line {r.randint(1, 30)} ran at {r.randint(600, 3600)} rpm for "
                f"{r.randint(2, 72)} hours before seal {ids.pick('part')} gave way.",
        lambda: f"Room {r.randint(1, 9)}{r.randint(0, 40):02d} keeps the spare drives; the key "
                f"is logged under {ids.pick('serial')}.",
        lambda: f"{who()} moved {r.randint(2, 400)} GB from {ids.pick('host')} to "
                f"{ids.pick('host')} overnight.",
        lambda: f"The vendor's reference for the fault is {ids.pick('part')}/{ids.digits(4)}.",
        lambda: f"Certificate {ids.hexs(16)} expires on {d()} at {t()}.",
        lambda: f"Trial {ids.digits(3)} enrolled {r.randint(12, 900)} people at "
                f"{r.randint(2, 40)} sites; the primary readout is due {d()}.",
        lambda: f"Flight {r.choice(string.ascii_uppercase)}{r.choice(string.ascii_uppercase)}"
                f"{r.randint(100, 9999)} landed at {t()} with {r.randint(2, 40)} crates for "
                f"order {ids.pick('order')}.",
        lambda: f"{who()} measured {r.randint(1, 99)}.{r.randint(0, 99):02d} {r.choice(UNITS)} "
                f"on instrument {ids.pick('serial')}, calibrated {d()}.",
        lambda: f"Since {d()} the cluster has served {ids.digits(r.randint(7, 10))} requests with "
                f"{r.randint(0, 9999)} errors.",
        lambda: f"The refund of {ids.amount()} EUR went to IBAN ending {ids.digits(4)} on {d()}.",
        lambda: f"Coordinates {r.randint(-89, 89)}.{ids.digits(5)}, {r.randint(-179, 179)}."
                f"{ids.digits(5)} mark the drop point for consignment {ids.pick('order')}.",
        lambda: f"{who()} asked for {ids.pick('path')} to be kept for {r.randint(2, 30)} days.",
    )
    # sentences without identifiers, between those with them
    plain = ("Nobody was paged.", "The cause turned out to be a stale cache entry.",
             "Everything else ran as planned.", "The customer was told the same afternoon.",
             "A second look found nothing unusual.", "The figures below come from the nightly "
             "export.", "This matches the earlier estimate.", "The supplier has confirmed it in "
             "writing.", "No data was lost.", "The team agreed to revisit it next week.")
    opener = r.choice(("Incident summary.", "Shipping note.", "Lab notebook, continued.",
                       "Change record.", "Weekly operations note.", "Audit trail."))
    n = r.randint(6, 14)
    body = " ".join(f() if r.random() > 0.2 else r.choice(plain) for f in r.sample(say, n))
    return f"{opener} {body}"


SECTIONS = dict(kv=kv_section, log=log_section, table=table_section, config=config_section,
                code=code_section, prose=prose_section)


# -------------------------------------------------------------------------------------------------
# documents and the corpus

def document(seed, i):
    """Document i of `seed` as (kind, text): its own generator, so it does not depend on the
    others."""
    r = random.Random(f"numeric-text {VERSION} {seed} {i}")
    kind, ids = KINDS[i % len(KINDS)], Ids(r)
    target = r.randint(*DOC_CHARS)
    parts, size = [], 0
    while size < target:
        k = kind if not parts or r.random() < OWN_KIND else r.choice(KINDS)
        parts.append(SECTIONS[k](r, ids))
        size += len(parts[-1]) + 2
    if size > DOC_CHARS[1] and len(parts) > 1:  # the last section overshot: drop it
        parts.pop()
    return kind, "\n\n".join(parts) + "\n"


def file_name(i, kind):
    return f"{i:05d}-{kind}.txt"


def is_corpus(folder):
    """Whether `folder` holds only what this generator writes (cli.claim_folder's test)."""
    return all(NAME.match(p.name) or p.name == RECORD for p in Path(folder).iterdir())


def write_corpus(out, docs, seed, quiet=False):
    """Documents 0..docs-1 of `seed` in `out`: each written atomically, those already there kept
    when they are this seed's (else refused, never overwritten). -> (written, kept, chars)."""
    from cli import UsageError, claim_folder, write_json, write_text
    claim_folder(out, "--out", is_corpus, "a numeric_text corpus", create=True)
    out = Path(out)
    record = dict(generator="offline/numeric_text.py", version=VERSION, seed=seed)
    if (out / RECORD).exists():
        try:
            old = json.loads((out / RECORD).read_text("utf-8"))
        except (OSError, ValueError):
            old = None
        if old != record:
            was = (f"--seed {old['seed']}, version {old['version']}"
                   if isinstance(old, dict) and {"seed", "version"} <= old.keys() else "unreadable")
            raise UsageError(f"--out {out} holds a corpus of other settings ({RECORD}: {was}); "
                             f"pass its --seed or another --out")
    # every file already there is checked before one is written: a refused run changes nothing
    there = {i for i in range(docs) if (out / file_name(i, document(seed, i)[0])).exists()}
    for i in sorted(there):
        kind, text = document(seed, i)
        path = out / file_name(i, kind)
        try:
            same = path.read_text("utf-8", errors="replace") == text
        except OSError:  # a folder by that name, a file we may not read
            same = False
        if not same:
            raise UsageError(f"{path} is not document {i} of --seed {seed}: it is left as it "
                             f"is; pass another --out")
    write_json(out / RECORD, record)
    from tqdm import tqdm
    written = chars = 0
    for i in tqdm(range(docs), desc="numeric text", unit="doc", disable=quiet, file=sys.stderr):
        kind, text = document(seed, i)
        chars += len(text)
        if i not in there:
            write_text(out / file_name(i, kind), text)
            written += 1
    kept = len(there)
    return written, kept, chars


def main(argv=None):
    from cli import add_seed
    from cli import main as cli_main
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the .txt documents: new, empty, or "
                   "one this program wrote with the same --seed (resumed or grown)")
    p.add_argument("--docs", type=int, default=20, help="documents to write (default 20)")
    add_seed(p, "the documents (another seed: another corpus, e.g. the held-out set)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.docs < 1:
        p.error(f"--docs must be >= 1, got {args.docs}")

    def run(args):
        written, kept, chars = write_corpus(args.out, args.docs, args.seed, args.quiet)
        print(f"{args.docs} documents ({written} written, {kept} kept), {chars} characters (about "
              f"{chars / CHARS_PER_TOKEN / 1000:.0f}K tokens) -> {args.out}")

    cli_main(run, args, kept=lambda a: (f"the documents written so far are kept in {a.out}; rerun "
                                        f"the same command to write the rest"))


if __name__ == "__main__":
    main()
