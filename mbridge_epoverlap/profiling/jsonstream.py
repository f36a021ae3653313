"""Streaming reader for the `traceEvents` array of a Chrome/Kineto JSON trace.

A 1 GB trace parsed with `json.load` needs several GB of Python objects. This reader keeps a few
megabytes of text and a handful of numpy columns instead:

1. The decompressed byte stream is read in blocks. Each block is cut just before the last event
   that opens with its `"ph"` key (kineto and `json.dump` both write `{"ph": ...}` first), so the
   part before the cut holds only whole events.
2. Fast path: one bytes regex picks out the head of every wanted complete event
   (`"ph": "X", "cat", "name", "pid", "tid", "ts", "dur"` in kineto's key order) and skips `args`
   unparsed. The number of heads found must equal the number of `"cat": "<wanted>"` pairs in the
   block; otherwise some wanted event uses another key order or number format.
3. Slow path, for such blocks, for blocks with duration events (`"ph": "B"` / `"E"`) and for files
   without `{"ph"` openings: `json.JSONDecoder.raw_decode` one event at a time. Numbers are kept as
   text in both paths and converted exactly.

Duration events are paired as the Chrome trace format defines them: an `E` ends the most recent open
`B` of the same pid and tid (a stack per thread, kept across blocks), and the pair becomes one
complete event with the `B`'s category and name. An `E` with no open `B`, and a `B` never ended, are
dropped.

Timestamps are microseconds; they are converted to integer nanoseconds by rounding half away from
zero, from the decimal text, so epoch-based values (about 1.7e15 us) lose no precision.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from mbridge_epoverlap.errors import UsageError

_BLOCK = 8 << 20
_MAX_PENDING = 64 << 20  # text kept without a cut point before the slow path parses it in place
_MAX_HEADER = 256 << 20

_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_EVENT_START = re.compile(rb'\{\s*"ph"\s*:')
_DURATION_EVENT = re.compile(rb'"ph"\s*:\s*"[BE]"')
_STR = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_NUM = rb"(-?)(\d+)(?:\.(\d*))?"
_SKIP = re.compile(r"[\s,]*")


def _head_pattern(cats: Iterable[str]) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    alt = b"|".join(re.escape(c.encode()) for c in cats)
    head = re.compile(
        rb'\{\s*"ph"\s*:\s*"X"\s*,\s*"cat"\s*:\s*"(' + alt + rb')"\s*,\s*"name"\s*:\s*(' + _STR + rb")"
        rb'\s*,\s*"pid"\s*:\s*(-?\d+|' + _STR + rb')\s*,\s*"tid"\s*:\s*(-?\d+|' + _STR + rb")"
        rb'\s*,\s*"ts"\s*:\s*' + _NUM + rb'\s*,\s*"dur"\s*:\s*' + _NUM + rb"\s*[,}]"
    )
    cat_pairs = re.compile(rb'"cat"\s*:\s*"(?:' + alt + rb')"')
    return head, cat_pairs


def micros_text_to_ns(signs: Sequence[bytes], ints: Sequence[bytes], fracs: Sequence[bytes]) -> np.ndarray:
    """Exact ns from decimal microsecond texts split as (sign, integer digits, fraction digits)."""
    if not ints:
        return np.empty(0, np.int64)
    whole = np.array(ints).astype(np.int64)
    ns = whole * 1000
    if any(fracs):
        digits = np.array(fracs, dtype="S4").view(np.uint8).reshape(-1, 4).astype(np.int16)
        digits = np.where(digits == 0, 0, digits - 48)  # padding bytes are NUL
        ns += digits[:, 0] * 100 + digits[:, 1] * 10 + digits[:, 2] + (digits[:, 3] >= 5)
    if b"-" in signs:
        ns = np.where(np.array(signs) == b"-", -ns, ns)
    return ns


_NUMBER_TEXT = re.compile(r"\s*(-?)(\d+)(?:\.(\d*))?\s*")


def micros_to_ns(value: object) -> int:
    """Exact ns from one JSON number (text, int or float) in microseconds."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, int):
        return value * 1000
    text = value if isinstance(value, str) else repr(float(value))
    m = _NUMBER_TEXT.fullmatch(text)
    if m is None:  # exponent form: rare; Decimal keeps it exact
        from decimal import ROUND_HALF_UP, Decimal

        return int((Decimal(text) * 1000).to_integral_value(rounding=ROUND_HALF_UP))
    frac = (m.group(3) or "").ljust(4, "0")
    ns = int(m.group(2)) * 1000 + int(frac[:3]) + (frac[3] >= "5")
    return -ns if m.group(1) else ns


def _json_string(raw: bytes) -> str:
    """Text of a JSON string literal (quotes included); a bad escape is kept verbatim, not fatal."""
    text = raw.decode("utf-8", "replace")
    if "\\" not in text:
        return text[1:-1]
    try:
        return json.loads(text)
    except ValueError:
        return text[1:-1]


@dataclass
class ScanResult:
    """Complete (`ph: "X"`) events, and `B`/`E` pairs, of the wanted categories, as columns.

    Attributes:
        header: Top-level keys other than `traceEvents` (e.g. `distributedInfo`).
        cat: int8 index into the wanted categories.
        name: int32 index into `names`.
        pid: int32 index into `values`.
        tid: int32 index into `values`.
        start: int64 start (ns).
        dur: int64 duration (ns).
        names: Distinct event names.
        values: Distinct pid/tid values (int or str).
    """

    header: dict = field(default_factory=dict)
    cat: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))
    name: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    pid: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    tid: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    start: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    dur: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    names: list[str] = field(default_factory=list)
    values: list[int | str] = field(default_factory=list)


class EventScanner:
    """Collects the complete events of some categories from one trace stream.

    Args:
        path: File name, for messages.
        cats: Categories to keep, e.g. ("kernel", "gpu_memcpy").
    """

    def __init__(self, path: str, cats: tuple[str, ...]) -> None:
        self.path = path
        self.cats = cats
        self._cat_code = {c: i for i, c in enumerate(cats)}
        self._cat_code_b = {c.encode(): i for i, c in enumerate(cats)}
        self._head, self._cat_pairs = _head_pattern(cats)
        self._names: list[str] = []
        self._name_raw: dict[bytes, int] = {}
        self._name_str: dict[str, int] = {}
        self._values: list[int | str] = []
        self._value_raw: dict[bytes, int] = {}
        self._value_obj: dict[int | str, int] = {}
        self._cols: list[tuple[np.ndarray, ...]] = []
        self._header: dict = {}
        self._decoder = json.JSONDecoder(parse_float=str)
        # Open `B` events per (pid, tid): (category code or None, name index, start ns).
        self._open: dict[tuple[int, int], list[tuple[int | None, int, int]]] = {}
        self.fast_blocks = 0  # blocks read by the regex path; the rest went through raw_decode
        self.slow_blocks = 0

    # -- interning -------------------------------------------------------------------------------

    def _name_from_str(self, text: str) -> int:
        idx = self._name_str.get(text)
        if idx is None:
            idx = self._name_str[text] = len(self._names)
            self._names.append(text)
        return idx

    def _value_from_obj(self, obj: object) -> int:
        key = obj if isinstance(obj, (int, str)) else str(obj)
        idx = self._value_obj.get(key)
        if idx is None:
            idx = self._value_obj[key] = len(self._values)
            self._values.append(key)
        return idx

    def _names_from_raw(self, raws: tuple[bytes, ...]) -> np.ndarray:
        table = self._name_raw
        for raw in set(raws).difference(table):  # decode each distinct JSON string once
            table[raw] = self._name_from_str(_json_string(raw))
        return np.fromiter(map(table.__getitem__, raws), np.int32, len(raws))

    def _values_from_raw(self, raws: tuple[bytes, ...]) -> np.ndarray:
        table = self._value_raw
        for raw in set(raws).difference(table):
            table[raw] = self._value_from_obj(_json_string(raw) if raw.startswith(b'"') else int(raw))
        return np.fromiter(map(table.__getitem__, raws), np.int32, len(raws))

    # -- blocks ----------------------------------------------------------------------------------

    def _fast(self, block: bytes) -> bool:
        if _DURATION_EVENT.search(block):
            return False  # B/E pairs need the per-thread stacks of the slow path
        heads = self._head.findall(block)
        if len(heads) != len(self._cat_pairs.findall(block)):
            return False
        self.fast_blocks += 1
        if not heads:
            return True
        cat, name, pid, tid, s_sign, s_int, s_frac, d_sign, d_int, d_frac = zip(*heads, strict=True)
        self._cols.append(
            (
                np.fromiter(map(self._cat_code_b.__getitem__, cat), np.int8, len(cat)),
                self._names_from_raw(name),
                self._values_from_raw(pid),
                self._values_from_raw(tid),
                micros_text_to_ns(s_sign, s_int, s_frac),
                micros_text_to_ns(d_sign, d_int, d_frac),
            )
        )
        return True

    def _keep(self, ev: object, rows: list[tuple[int, int, int, int, int, int]]) -> None:
        if not isinstance(ev, dict):
            return
        if ev.get("ph") in ("B", "E"):
            self._duration_event(ev, rows)
            return
        if ev.get("ph") != "X":
            return
        code = self._cat_code.get(ev.get("cat"))  # type: ignore[arg-type]
        if code is None:
            return
        try:
            start = micros_to_ns(ev.get("ts"))
            dur = micros_to_ns(ev.get("dur", 0))
        except (ValueError, ArithmeticError):
            return  # an event without a usable time cannot be placed; skip it
        name = ev.get("name")
        rows.append(
            (
                code,
                self._name_from_str(name if isinstance(name, str) else str(name)),
                self._value_from_obj(ev.get("pid", "")),
                self._value_from_obj(ev.get("tid", "")),
                start,
                dur,
            )
        )

    def _duration_event(self, ev: dict, rows: list[tuple[int, int, int, int, int, int]]) -> None:
        """Push a `B` on its thread's stack; an `E` pops it and, for a wanted category, adds the pair."""
        try:
            ts = micros_to_ns(ev.get("ts"))
        except (ValueError, ArithmeticError):
            return
        pid, tid = self._value_from_obj(ev.get("pid", "")), self._value_from_obj(ev.get("tid", ""))
        stack = self._open.setdefault((pid, tid), [])
        if ev["ph"] == "B":
            name = ev.get("name")
            # Every B is pushed, wanted or not, so each E closes the right one.
            stack.append((self._cat_code.get(ev.get("cat")),  # type: ignore[arg-type]
                          self._name_from_str(name if isinstance(name, str) else str(name)), ts))
            return
        if not stack:
            return  # an E without an open B
        code, name_idx, start = stack.pop()
        if code is not None and ts >= start:
            rows.append((code, name_idx, pid, tid, start, ts - start))

    def _flush(self, rows: list[tuple[int, int, int, int, int, int]]) -> None:
        if rows:
            cat, name, pid, tid, start, dur = zip(*rows, strict=True)
            self._cols.append(
                (
                    np.array(cat, np.int8),
                    np.array(name, np.int32),
                    np.array(pid, np.int32),
                    np.array(tid, np.int32),
                    np.array(start, np.int64),
                    np.array(dur, np.int64),
                )
            )

    def _slow(self, block: bytes, final: bool, whole: bool = False) -> tuple[int, bool]:
        """Parse events one by one; returns (bytes consumed, whether the array closed).

        `whole` says the block ends on an event boundary, so a parse error is an error, not an event
        cut by the block end; `final` says the stream ends with the block.
        """
        end = len(block) if final or whole else block.rfind(b"}") + 1
        self.slow_blocks += 1
        text = block[:end].decode("utf-8", "surrogateescape")  # byte offsets survive a round trip
        pos, rows, closed = 0, [], False
        while True:
            pos = _SKIP.match(text, pos).end()  # type: ignore[union-attr]
            if pos >= len(text):
                break
            if text[pos] == "]":
                closed = True
                pos += 1
                break
            try:
                ev, pos_next = self._decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                if final or whole:
                    self._flush(rows)
                    raise UsageError(
                        f"{self.path}: malformed or truncated trace JSON near byte {exc.pos} of an event "
                        f"({exc.msg}); the file was cut short, write it again (torch.profiler export_chrome_trace)"
                    ) from None
                break
            self._keep(ev, rows)
            pos = pos_next
        self._flush(rows)
        consumed = len(text[:pos].encode("utf-8", "surrogateescape"))
        if final and not closed:
            raise UsageError(
                f"{self.path}: trace JSON ends inside traceEvents (truncated); the profiler did not finish writing "
                "it, profile again"
            )
        return consumed, closed

    # -- driver ----------------------------------------------------------------------------------

    def _read(self, stream: BinaryIO) -> bytes:
        try:
            return stream.read(_BLOCK)
        except (EOFError, OSError, zlib.error) as exc:
            raise UsageError(
                f"{self.path}: compressed stream is damaged or truncated ({exc}); copy or write the trace again"
            ) from None

    def _parse_header(self, prefix: bytes) -> None:
        body = prefix.strip()
        if body.startswith(b"{"):
            body = body.rstrip().rstrip(b",") + b"}"
            try:
                header = json.loads(body)
            except ValueError:
                raise UsageError(
                    f"{self.path}: malformed JSON before traceEvents; this is not a Kineto/Chrome trace"
                ) from None
            if isinstance(header, dict):
                self._header.update(header)

    def _parse_trailer(self, rest: bytes) -> None:
        body = rest.strip()
        if body.startswith(b","):
            try:
                trailer = json.loads(b"{" + body[1:])
            except ValueError:
                raise UsageError(f"{self.path}: malformed JSON after traceEvents; the file may be cut short") from None
            if isinstance(trailer, dict):
                self._header.update(trailer)
        elif body not in (b"}", b""):
            raise UsageError(f"{self.path}: unexpected text after traceEvents; the file may be damaged")

    def _no_events_key(self, text: bytes) -> UsageError:
        try:
            json.loads(text)
        except ValueError:
            return UsageError(
                f"{self.path}: not valid JSON (or truncated) and no traceEvents array found; pass a Kineto/Chrome "
                "trace as written by torch.profiler (export_chrome_trace or tensorboard_trace_handler)"
            )
        return UsageError(
            f"{self.path}: JSON without a traceEvents array, so it is not a Kineto/Chrome trace; pass the file "
            "torch.profiler's export_chrome_trace or tensorboard_trace_handler writes"
        )

    def scan(self, stream: BinaryIO) -> ScanResult:
        """Read the whole stream and return the wanted events.

        Raises:
            UsageError: Not a trace, malformed, or truncated.
        """
        buf = b""
        # Header: everything up to `"traceEvents": [` (or a bare top-level array).
        while True:
            data = self._read(stream)
            buf += data
            stripped = buf.lstrip(b"\xef\xbb\xbf \t\r\n")
            if stripped.startswith(b"["):
                buf = stripped[1:]
                break
            m = _EVENTS_KEY.search(buf)
            if m:
                self._parse_header(buf[: m.start()])
                buf = buf[m.end() :]
                break
            if not data or len(buf) > _MAX_HEADER:
                raise self._no_events_key(buf)
        # Events.
        closed = False
        while not closed:
            data = self._read(stream)
            buf += data
            if not data:
                consumed, closed = self._slow(buf, final=True)
                buf = buf[consumed:]
                break
            cut = self._last_event_start(buf)
            if cut > 0:
                block, buf = buf[:cut], buf[cut:]
                if not self._fast(block):
                    self._slow(block, final=False, whole=True)
            elif len(buf) > _MAX_PENDING:
                consumed, closed = self._slow(buf, final=False)
                buf = buf[consumed:]
        # Trailer: keys after the array.
        while True:
            data = self._read(stream)
            if not data:
                break
            buf += data
        self._parse_trailer(buf)
        return self._result()

    @staticmethod
    def _last_event_start(buf: bytes) -> int:
        window = 1 << 20
        while True:
            lo = max(0, len(buf) - window)
            last = -1
            for m in _EVENT_START.finditer(buf, lo):
                last = m.start()
            if last >= 0 or lo == 0:
                return max(last, 0)
            window *= 8

    def _result(self) -> ScanResult:
        res = ScanResult(header=self._header, names=self._names, values=self._values)
        if self._cols:
            cat, name, pid, tid, start, dur = (np.concatenate(c) for c in zip(*self._cols, strict=True))
            res.cat, res.name, res.pid, res.tid, res.start, res.dur = cat, name, pid, tid, start, dur
        return res


def scan_events(stream: BinaryIO, path: str, cats: tuple[str, ...]) -> ScanResult:
    """Complete events of the given categories from a trace byte stream (see `EventScanner`)."""
    return EventScanner(path, cats).scan(stream)
