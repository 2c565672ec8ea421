"""Incremental detokenization (split UTF-8 characters) and stop strings whose deltas add up to the final text."""

from m3export.runtime.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = byte value; decoding a split UTF-8 character yields U+FFFD like byte-level BPE does."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        """Ids >= 256 play the special tokens: dropped unless skip_special_tokens=False spells them <id>."""
        return b"".join(bytes([i]) if i < 256 else (b"" if skip_special_tokens else f"<{i}>".encode())
                        for i in ids).decode("utf-8", errors="replace")


def _feed(det, data: bytes):
    deltas, stopped = [], False
    for b in data:
        stopped = det.append(b)
        deltas.append(det.release(stopped))
        if stopped:
            break
    return deltas, stopped


def test_split_characters_are_released_whole():
    det = IncrementalDetokenizer(ByteTokenizer(), ())
    deltas, stopped = _feed(det, "aé€😀b".encode())
    assert not stopped
    assert "".join(deltas) == det.text == "aé€😀b"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_text_and_never_streams_it():
    det = IncrementalDetokenizer(ByteTokenizer(), ("STOP", "xyz"))
    deltas, stopped = _feed(det, b"hello STOP world")
    assert stopped and det.text == "hello " and "".join(deltas) == "hello "
    det = IncrementalDetokenizer(ByteTokenizer(), ("STOP",))
    deltas, stopped = _feed(det, b"no STO stop here")
    assert not stopped and "".join(deltas) + det.release(True) == "no STO stop here"


def test_finished_text_equals_decoding_everything():
    det = IncrementalDetokenizer(ByteTokenizer(), ())
    data = "ok €".encode()[:-1]  # ends inside a character
    deltas, _ = _feed(det, data)
    assert "".join(deltas) == "ok "
    assert det.release(True) == "\ufffd" and det.text == ByteTokenizer().decode(list(data))


def test_without_tokenizer_text_is_empty():
    det = IncrementalDetokenizer(None, ())
    assert det.append(65) is False and det.release(True) == "" and det.text == ""


def test_special_tokens_kept_on_request():
    data = [ord("a"), 300, ord("b")]
    kept = IncrementalDetokenizer(ByteTokenizer(), (), skip_special_tokens=False)
    dropped = IncrementalDetokenizer(ByteTokenizer(), ())
    for det in (kept, dropped):
        for t in data:
            det.append(t)
    assert kept.release(True) == "a<300>b" and dropped.release(True) == "ab"


def test_unreported_text_stays_short():
    """The detokenizer keeps the reported text in pieces and only the held-back tail unreported, so a token costs
    the same whatever came before (a text grown by += was copied whole at every token); the pieces join to the
    text."""
    det = IncrementalDetokenizer(ByteTokenizer(), ("STOPPING",))
    data = b"word " * 400
    deltas, stopped = _feed(det, data)
    assert not stopped and len(det._pending) <= len("STOPPING") - 1
    assert "".join(deltas) + det.release(True) == det.text == data.decode()
