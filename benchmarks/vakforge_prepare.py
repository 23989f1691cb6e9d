"""Hours of audio `vakforge prepare` turns into a dataset per hour of wall time (issue 18).

Run from the repository root:

    python benchmarks/vakforge_prepare.py                  # 10 minutes of audio
    python benchmarks/vakforge_prepare.py --minutes=2 --conversation-seconds=30

Writes, in a temporary folder, `--minutes` of real-ish raw uploads: conversations of about
`--conversation-seconds`, each a 44.1 kHz stereo PCM16 WAV with eSpeak NG speech (user on channel 0,
agent on channel 1, different voices) over low noise, and a manifest marking them `source: real` with
a phone number or an e-mail address in some user turns, so prepare decodes, resamples to 24 kHz,
detects every turn's language, redacts, tones and writes everything a real upload needs. The
language and PII libraries are loaded before the clock starts (a one-off per process, printed apart).

It also prints how far a character-proportional placement of each redacted value inside its turn
would miss the true word times eSpeak NG reports: the figure behind prepare toning whole turns.

The last line is `prepare_realtime_factor=X`: seconds of audio prepared per second of wall time
(equal to hours per hour).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import soundfile  # noqa: E402

from data_pipeline.vakforge.audio import Recording, resample  # noqa: E402
from data_pipeline.vakforge.espeak import ESpeak, Voice  # noqa: E402
from data_pipeline.vakforge.prepare import prepare  # noqa: E402

RATE = 44100
AGENT = [
    "Thank you for calling Kaveri Bank, this is Rahul. How can I help you today?",
    "I can help with that. Could you confirm the number registered with us?",
    "Thank you. I have sent a one time password to that number.",
    "Your details are updated. Is there anything else I can do for you?",
    "The new card will reach your address within five working days.",
    "I see the payment was received yesterday, so the fee has been waived.",
]
USER = [
    "Hi, I would like to update the contact details on my account.",
    "Sure, my number is 98765 43210.",
    "You can also write to me at asha.k@example.com if that is easier.",
    "Yes, I got the password, thank you.",
    "No, that is all, thanks for your help.",
    "My old number was 91234 56780 but I do not use it any more.",
]
PII = ("98765 43210", "asha.k@example.com", "91234 56780")
VOICES = {"user": Voice("en", "m3", 35), "agent": Voice("en", "f2", 65)}


def speech_pool() -> dict[str, list[np.ndarray]]:
    engine = ESpeak.engine()
    pool = {}
    for speaker, lines in (("agent", AGENT), ("user", USER)):
        pool[speaker] = [resample(Recording(engine.speak(line, VOICES[speaker])[:, None], engine.sample_rate),
                                  RATE).samples[:, 0] for line in lines]
    return pool


def write_raw(folder: Path, minutes: float, conversation_s: float, seed: int) -> float:
    """Raw uploads and their manifest; returns the seconds of audio written."""
    rng = np.random.default_rng(seed)
    pool = speech_pool()
    (folder / "uploads").mkdir(parents=True)
    rows, total, k = [], 0.0, 0
    while total < minutes * 60:
        cid = f"conv_{k:05d}"
        turns, clips, clock, speaker = [], [], 0.3, "agent"
        while clock < conversation_s:
            line = int(rng.integers(len(pool[speaker])))
            speech = pool[speaker][line]
            first = round(clock * RATE)
            end = round((first + len(speech)) / RATE, 3)
            text = (AGENT if speaker == "agent" else USER)[line]
            turns.append({"speaker": speaker, "start": round(clock, 3), "end": end, "text": text})
            clips.append((0 if speaker == "user" else 1, first, speech))
            clock = end + float(rng.uniform(0.2, 0.8))
            speaker = "user" if speaker == "agent" else "agent"
        samples = rng.standard_normal((round((clock + 0.3) * RATE), 2)).astype(np.float32) * 0.003
        for channel, first, speech in clips:
            samples[first:first + len(speech), channel] += 0.8 * speech
        name = f"uploads/{cid}.wav"
        soundfile.write(folder / name, samples, RATE, subtype="PCM_16")
        duration = len(samples) / RATE
        rows.append({
            "id": cid, "schema_version": "0.1",
            "audio": {"path": name, "sample_rate": RATE, "channels": 2, "channel_map": {"0": "user", "1": "agent"},
                      "duration_s": round(duration, 3), "condition": "clean"},
            "locale": "en-IN", "language": {"primary": "en-IN", "mix": ["en", "hi"]}, "turns": turns,
            "meta": {"source": "real", "consent": "recorded_verbal", "consent_ref": "policy-v3-2026",
                     "voice_consent_ref": "voice-consent-v1-2026", "pii_redacted": False},
        })
        total += duration
        k += 1
    (folder / "vakforge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "splits.json").write_text(json.dumps({"seed": seed, "splits": {"train": [r["id"] for r in rows]}}))
    return total


def proportional_misses() -> list[float]:
    """Seconds by which a character-proportional span misses eSpeak NG's word times (start and end)."""
    engine = ESpeak.engine()
    misses = []
    for line in USER:
        for value in PII:
            at = line.find(value)
            if at < 0:
                continue
            speech, words = engine.speak_words(line, VOICES["user"])
            length_s = len(speech) / engine.sample_rate
            starts = [(c, t) for c, t in words]
            true_start = next(t for c, t in starts if c >= at)
            true_end = next((t for c, t in starts if c >= at + len(value)), length_s)
            guess = (length_s * at / len(line), length_s * (at + len(value)) / len(line))
            misses += [abs(guess[0] - true_start), abs(guess[1] - true_end)]
    return misses


def warm_up() -> float:
    from data_pipeline.vakforge.language import detect_lang
    from data_pipeline.vakforge.redact import redact_record

    began = time.perf_counter()
    detect_lang("Hello there, how are you?", "en-IN")
    redact_record({"id": "w", "turns": [{"speaker": "user", "text": "call 98765 43210"}]}, "en-IN")
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--conversation-seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = Path(tmp) / "raw", Path(tmp) / "data"
        began = time.perf_counter()
        seconds = write_raw(raw, args.minutes, args.conversation_seconds, args.seed)
        print(f"raw uploads: {seconds / 60:.1f} min of 44.1 kHz stereo speech+noise in "
              f"{len((raw / 'vakforge.jsonl').read_text().splitlines())} conversations "
              f"(made in {time.perf_counter() - began:.1f} s)")
        print(f"language and PII libraries loaded in {warm_up():.1f} s (once per process, not timed below)")
        began = time.perf_counter()
        summary = prepare(raw, raw / "vakforge.jsonl", out)
        wall = time.perf_counter() - began
    misses = proportional_misses()
    print(f"prepared {summary.rows} rows, {summary.audio_seconds / 3600:.4f} h of audio in {wall:.1f} s: "
          f"{summary.langs_set} turn languages, {summary.spans} redacted spans, {summary.toned_spans} tones")
    print(f"character-proportional placement of a redacted value vs eSpeak NG word times: median miss "
          f"{statistics.median(misses):.2f} s, worst {max(misses):.2f} s over {len(misses)} span edges "
          "(prepare tones whole turns instead)")
    print(f"prepare_realtime_factor={summary.audio_seconds / wall:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
