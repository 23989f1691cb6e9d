"""Write the deterministic synthetic vakforge smoke data set under `data/smoke/vakforge/`.

Run from the repository root (re-running gives byte-identical files):

    .venv/bin/python data/make_vakforge_smoke.py                          # writes data/smoke/vakforge/
    .venv/bin/python data/make_vakforge_smoke.py --out /tmp/vakforge
    .venv/bin/python -m data_pipeline.validate --format=vakforge data/smoke/vakforge/vakforge.jsonl

Layout (seed 002, "Layout on disk"): `vakforge.jsonl` (5 conversations in the locales en-US,
hi-Latn-IN, en-GB, zh-CN and en-IN), `audio/` (a 24 kHz stereo FLAC, a 16 kHz stereo FLAC and an
8 kHz mono phone WAV), `redactions/` (the logs of the two `source: real` conversations, whose text
carries placeholders such as <PHONE_1>), `splits.json` and `vakforge.schema.json`.

What the set exercises: tool calls with results (object, list and string content) and one final
call left unanswered, entities with and without offsets, code-switched turns (Hinglish, Spanglish,
Chinese–English), overlapping turns, both channel-map orders, every `source` and four `consent`
kinds, and speakers that stay in one split.

The audio is a tone per spoken turn on the speaker's channel (mono: on the one channel), silence
elsewhere, computed without randomness; WAV is written by the stdlib `wave` module and FLAC by
PyAV with the `bitexact` flags, so neither carries timestamps or encoder versions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import wave
from pathlib import Path

import numpy as np

SPLITS_SEED = 20260916
TONE_HZ = {"agent": 330.0, "user": 220.0}
AMPLITUDE = 2000  # of 32767: quiet, so the FLAC files stay small


def spoken(speaker: str, start: float, end: float, text: str, lang: str, **extra) -> dict:
    turn = {"speaker": speaker, "start": start, "end": end, "text": text, "lang": lang}
    if "entities" in extra:
        turn["entities"] = [_entity(text, *e) for e in extra.pop("entities")]
    turn.update(extra)
    return turn


def _entity(text: str, kind: str, value: str, normalized: object = None, offsets: bool = True) -> dict:
    entity: dict = {"type": kind, "text": value}
    if normalized is not None:
        entity["normalized"] = normalized
    if offsets:
        start = text.index(value)
        entity.update(start_char=start, end_char=start + len(value))
    return entity


def call(at: float, call_id: str, name: str, arguments: dict) -> dict:
    return {"speaker": "agent", "start": at, "end": at, "tool_call": {"id": call_id, "name": name, "arguments": arguments}}


def result(at: float, call_id: str, content: object) -> dict:
    return {"speaker": "tool", "start": at, "end": at, "tool_result": {"id": call_id, "content": content}}


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required, "additionalProperties": False},
    }


def conversations() -> list[dict]:
    en_us = {
        "id": "conv_en_us_0001",
        "schema_version": "0.1",
        "audio": {"path": "audio/conv_en_us_0001.flac", "sample_rate": 24000, "channels": 2,
                  "channel_map": {"0": "user", "1": "agent"}, "duration_s": 4.5, "condition": "studio"},
        "locale": "en-US",
        "language": {"primary": "en-US", "mix": ["en", "es"]},
        "domain": "retail_support",
        "scenario": "order_status",
        "system_prompt": "You are Aria from Northwind support. Look up orders and give delivery dates.",
        "tools": [tool("lookup_order", "Look up the status of an order",
                       {"order_id": {"type": "string", "pattern": "^NW-[0-9]+$"}}, ["order_id"])],
        "turns": [
            spoken("agent", 0.0, 1.0, "Thanks for calling Northwind, this is Aria. How can I help?", "en-US"),
            spoken("user", 1.1, 2.1, "Hi, where is my order NW-20417?", "en-US",
                   entities=[("order_id", "NW-20417")]),
            call(2.1, "call_1", "lookup_order", {"order_id": "NW-20417"}),
            result(2.1, "call_1", {"status": "shipped", "eta": "2026-09-20"}),
            spoken("agent", 2.2, 3.6, "It shipped and should arrive on September 20.", "en-US",
                   entities=[("date", "September 20", "2026-09-20")]),
            spoken("user", 3.5, 4.2, "Gracias, perfecto.", "es-US", overlap=True),
        ],
        "meta": {"source": "synthetic", "consent": "synthetic", "license": "CC0-1.0", "pii_redacted": False,
                 "transcription": {"engine": "script", "verified_by_human": True},
                 "diarization": {"engine": "channels", "confidence": 1.0},
                 "speakers": {"agent": "tts_voice_aria", "user": "synthetic_user_01"},
                 "split": "train", "created": "2026-09-16T10:00:00Z"},
    }
    hi = {
        "id": "conv_hi_0002",
        "schema_version": "0.1",
        "audio": {"path": "audio/conv_hi_0002.wav", "sample_rate": 8000, "channels": 1,
                  "duration_s": 3.5, "condition": "phone"},
        "locale": "hi-Latn-IN",
        "language": {"primary": "hi-Latn", "mix": ["hi", "en"]},
        "domain": "field_service_support",
        "scenario": "book_site_visit",
        "system_prompt": "You are Priya from SunCare Solar support. Verify the customer, check the ticket, "
                         "book a visit if needed. Speak Hinglish if the customer does.",
        "tools": [
            tool("check_status", "Look up the current status of a customer's installation",
                 {"customer_id": {"type": "string"}}, ["customer_id"]),
            tool("book_appointment", "Book a technician visit",
                 {"customer_id": {"type": "string"}, "date": {"type": "string", "format": "date"},
                  "slot": {"type": "string", "enum": ["morning", "afternoon"]}},
                 ["customer_id", "date", "slot"]),
        ],
        "turns": [
            spoken("agent", 0.0, 0.8, "Namaste, SunCare Solar se Priya bol rahi hoon.", "hi-Latn"),
            spoken("user", 0.9, 1.6, "Haan, mera number <PHONE_1> hai, customer ID SC-4471.", "hi-Latn",
                   entities=[("customer_id", "SC-4471")]),
            spoken("agent", 1.5, 1.9, "Ek minute, check karti hoon.", "hi-Latn", overlap=True),
            call(1.9, "call_1", "check_status", {"customer_id": "SC-4471"}),
            result(1.9, "call_1", {"status": "fault_reported", "last_service": "2026-06-02"}),
            spoken("agent", 2.0, 2.8, "Fault already logged hai. Kal subah ka slot book kar doon? Charge ₹500 hoga.",
                   "hi-Latn", entities=[("amount_inr", "₹500", 500, False)]),
            spoken("user", 2.9, 3.3, "Yes, please book it.", "en-IN"),
            # Seed 002: a call in the final turn may go unanswered (the recording was cut off).
            call(3.4, "call_2", "book_appointment", {"customer_id": "SC-4471", "date": "2026-09-17", "slot": "morning"}),
        ],
        "meta": {"source": "real", "consent": "recorded_verbal", "consent_ref": "policy-v3-2026",
                 "voice_consent_ref": "voice-consent-v1-2026", "license": "proprietary-internal",
                 "pii_redacted": True, "redaction_log": "redactions/conv_hi_0002.json",
                 "transcription": {"engine": "faster-whisper-large-v3", "verified_by_human": False},
                 "diarization": {"engine": "pyannote", "confidence": 0.82},
                 "speakers": {"agent": "agent_priya", "user": "cust_7f3a"},
                 "split": "train", "created": "2026-09-16T10:12:00Z"},
    }
    gb = {
        "id": "conv_en_gb_0003",
        "schema_version": "0.1",
        "locale": "en-GB",
        "language": {"primary": "en-GB", "mix": ["en"]},
        "domain": "utilities",
        "scenario": "meter_reading",
        "tools": [tool("submit_meter_reading", "Record a gas meter reading",
                       {"account_ref": {"type": "string"}, "reading": {"type": "integer", "minimum": 0}},
                       ["account_ref", "reading"])],
        "turns": [
            spoken("user", 0.0, 2.0, "Hello, I'd like to submit a meter reading.", "en-GB"),
            spoken("agent", 2.1, 3.0, "Of course. What does the meter show?", "en-GB"),
            spoken("user", 3.1, 4.0, "It shows 04512.", "en-GB", entities=[("meter_reading", "04512", 4512)]),
            call(4.1, "call_a", "submit_meter_reading", {"account_ref": "ACC-88", "reading": 4512}),
            result(4.1, "call_a", "Reading accepted"),
            spoken("agent", 4.3, 5.0, "Thanks, that's been recorded.", "en-GB"),
        ],
        "meta": {"source": "public", "consent": "public_license", "license": "CC-BY-4.0", "pii_redacted": False,
                 "speakers": {"agent": "agent_gb_01"}, "split": "dev", "created": "2026-09-16T11:00:00Z"},
    }
    zh = {
        "id": "conv_zh_0004",
        "schema_version": "0.1",
        "audio": {"path": "audio/conv_zh_0004.flac", "sample_rate": 16000, "channels": 2,
                  "channel_map": {"0": "agent", "1": "user"}, "duration_s": 4.0, "condition": "clean"},
        "locale": "zh-CN",
        "language": {"primary": "zh-CN", "mix": ["zh", "en"]},
        "domain": "logistics",
        "scenario": "track_parcel",
        "system_prompt": "你是顺达快递的客服小美。帮客户查询快递状态。",
        "tools": [tool("track_parcel", "查询快递轨迹", {"tracking_no": {"type": "string"}}, ["tracking_no"])],
        "turns": [
            spoken("agent", 0.0, 1.0, "您好，这里是顺达快递客服，请问有什么可以帮您？", "zh-CN"),
            spoken("user", 1.1, 2.0, "我想查一下快递 SD1234 到哪了。", "zh-CN", entities=[("order_id", "SD1234")]),
            call(2.0, "call_1", "track_parcel", {"tracking_no": "SD1234"}),
            result(2.0, "call_1", [{"time": "2026-09-15 08:00", "event": "已揽收"},
                                   {"time": "2026-09-16 09:30", "event": "派送中"}]),
            spoken("agent", 2.1, 3.2, "您的快递正在派送中，今天下午会到。", "zh-CN"),
            spoken("user", 3.3, 3.8, "OK, thanks!", "en"),
        ],
        # Synthetic rows need no redaction, but one that claims it is re-checked all the same.
        "meta": {"source": "synthetic", "consent": "synthetic", "license": "CC0-1.0", "pii_redacted": True,
                 "transcription": {"engine": "script", "verified_by_human": True},
                 "speakers": {"agent": "tts_voice_xiaomei", "user": "synthetic_user_02"},
                 "split": "test", "created": "2026-09-16T12:00:00Z"},
    }
    en_in = {
        "id": "conv_en_in_0005",
        "schema_version": "0.1",
        "locale": "en-IN",
        "language": {"primary": "en-IN", "mix": ["en", "hi"]},
        "domain": "banking",
        "scenario": "update_email",
        "system_prompt": "You are Rahul from Kaveri Bank chat support. Verify the OTP before changing details.",
        "tools": [tool("update_email", "Change the e-mail address of a customer",
                       {"customer_ref": {"type": "string"}, "email": {"type": "string"}}, ["customer_ref", "email"])],
        "turns": [
            spoken("user", 0.0, 4.0, "Hi, I need to update my email to <EMAIL_1>.", "en-IN"),
            spoken("agent", 9.0, 12.0, "Sure, I have sent an OTP to your registered number.", "en-IN"),
            spoken("user", 30.0, 32.0, "Haan, OTP mil gaya, 4821 hai.", "hi-Latn",
                   entities=[("otp", "4821")]),
            call(35.0, "call_1", "update_email", {"customer_ref": "C-5512", "email": "<EMAIL_1>"}),
            result(35.0, "call_1", {"ok": True}),
            spoken("agent", 36.0, 38.0, "Done, your email is updated.", "en-IN"),
        ],
        "meta": {"source": "real", "consent": "written", "consent_ref": "chat-terms-2026-02",
                 "license": "proprietary-internal", "pii_redacted": True,
                 "redaction_log": "redactions/conv_en_in_0005.json",
                 "speakers": {"agent": "agent_rahul", "user": "cust_19bd"},
                 "split": "test", "created": "2026-09-16T13:00:00Z"},
    }
    return [en_us, hi, gb, zh, en_in]


REDACTION_LOGS = {
    "conv_hi_0002": [
        {"turn": 1, "field": "text", "type": "phone", "start": 18, "end": 28, "placeholder": "<PHONE_1>",
         "audio": {"start_s": 1.1, "end_s": 1.4, "method": "tone"}},
    ],
    "conv_en_in_0005": [
        {"turn": 0, "field": "text", "type": "email", "start": 33, "end": 52, "placeholder": "<EMAIL_1>"},
        {"turn": 3, "field": "tool_call.arguments.email", "type": "email", "start": 0, "end": 19,
         "placeholder": "<EMAIL_1>"},
    ],
}


def render_audio(conv: dict) -> np.ndarray:
    """int16 samples, shape (samples, channels): a tone per spoken turn on its speaker's channel."""
    audio = conv["audio"]
    rate, channels = audio["sample_rate"], audio["channels"]
    samples = np.zeros((round(audio["duration_s"] * rate), channels), dtype=np.int16)
    by_speaker = {v: int(k) for k, v in audio.get("channel_map", {}).items()}
    for turn in conv["turns"]:
        if "text" not in turn:
            continue
        start, end = round(turn["start"] * rate), round(turn["end"] * rate)
        t = np.arange(end - start) / rate
        # A 10 ms fade at both ends keeps the tone from clicking (and FLAC from wasting bits on it).
        fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
        tone = np.round(AMPLITUDE * fade * np.sin(2 * np.pi * TONE_HZ[turn["speaker"]] * t)).astype(np.int16)
        channel = by_speaker.get(turn["speaker"], 0)
        samples[start:end, channel] = tone if channels == 1 else samples[start:end, channel] + tone
    return samples


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(samples.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype("<i2").tobytes())


def write_flac(path: Path, samples: np.ndarray, rate: int) -> None:
    import av  # local import: only FLAC needs PyAV

    layout = "stereo" if samples.shape[1] == 2 else "mono"
    with av.open(str(path), "w", format="flac", container_options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("flac", rate=rate, layout=layout)
        stream.codec_context.options = {"flags": "+bitexact"}
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples).reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate, frame.pts = rate, 0
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> dict[str, int]:
    from data_pipeline.formats.vakforge_schema import json_schema

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/smoke/vakforge", help="output folder (replaced)")
    out = Path(parser.parse_args(argv).out)
    if out.exists():
        shutil.rmtree(out)
    (out / "audio").mkdir(parents=True)
    convs = conversations()
    with (out / "vakforge.jsonl").open("w", encoding="utf-8", newline="\n") as manifest:
        for conv in convs:
            manifest.write(json.dumps(conv, ensure_ascii=False) + "\n")
    for conv in convs:
        if "audio" in conv:
            writer = write_flac if conv["audio"]["path"].endswith(".flac") else write_wav
            writer(out / conv["audio"]["path"], render_audio(conv), conv["audio"]["sample_rate"])
    for cid, spans in REDACTION_LOGS.items():
        write_json(out / "redactions" / f"{cid}.json", {"conversation_id": cid, "spans": spans})
    splits: dict[str, list[str]] = {}
    for conv in convs:
        splits.setdefault(conv["meta"]["split"], []).append(conv["id"])
    write_json(out / "splits.json", {"seed": SPLITS_SEED, "splits": splits})
    write_json(out / "vakforge.schema.json", json_schema())
    return {"conversations": len(convs), "audio": sum("audio" in c for c in convs)}


if __name__ == "__main__":
    print(main())
