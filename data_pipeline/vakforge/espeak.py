"""Offline speech from eSpeak NG's C library, through ctypes (issue 18, `synth`).

The library and its voice data ship inside the `espeakng-loader` wheel, so nothing is downloaded
and no system binary is run. eSpeak NG keeps one global engine per process; it is initialised once
in synchronous mode (`AUDIO_OUTPUT_SYNCHRONOUS`: `espeak_Synth` returns when the text is rendered)
and a synth callback collects the 16-bit samples.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from data_pipeline.vakforge.audio import missing_extra

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_ESPEAK_CHARS_UTF8 = 1
_EE_OK = 0
_RATE, _PITCH, _RANGE = 1, 3, 4

_EVENT_LIST_TERMINATED, _EVENT_WORD = 0, 1


class _Event(ctypes.Structure):
    """espeak_EVENT (speak_lib.h); `id` is a union of int, const char* and char[8]."""

    _fields_ = [
        ("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
        ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass(frozen=True)
class Voice:
    """An eSpeak NG voice: language voice name (`en-us`, `hi`, `cmn`), variant (`m3`, `f2`), pitch 0–100."""

    name: str
    variant: str
    pitch: int
    rate_wpm: int = 165

    @property
    def full_name(self) -> str:
        return f"{self.name}+{self.variant}"


class ESpeak:
    """The process's eSpeak NG engine: `speak(text, voice)` → mono float32 samples at `sample_rate`."""

    _instance: ESpeak | None = None
    _lock = threading.Lock()

    def __init__(self):
        try:
            import espeakng_loader
        except ImportError:
            raise missing_extra("espeakng-loader") from None
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_void_p, ctypes.c_void_p,
        ]
        data = espeakng_loader.get_data_path().encode()
        # The data path names the folder that holds espeak-ng-data, or that folder itself in
        # espeak-ng >= 1.51; passing espeak-ng-data's parent works for both.
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data.rsplit(b"/", 1)[0], 0)
        if rate <= 0:
            raise RuntimeError(f"eSpeak NG did not initialise from {data.decode()} (returned {rate})")
        self.sample_rate = rate
        self._lib = lib
        self._chunks: list[np.ndarray] = []
        self._words: list[tuple[int, int]] = []

        def collect(wav, count, events):
            if count > 0:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
            k = 0
            while events and events[k].type != _EVENT_LIST_TERMINATED:
                if events[k].type == _EVENT_WORD:
                    # text_position counts characters from 1; audio_position is milliseconds.
                    self._words.append((events[k].text_position - 1, events[k].audio_position))
                k += 1
            return 0

        self._callback = _CALLBACK(collect)  # kept referenced: the library calls it later
        lib.espeak_SetSynthCallback(self._callback)

    @classmethod
    def engine(cls) -> ESpeak:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def speak(self, text: str, voice: Voice) -> np.ndarray:
        return self.speak_words(text, voice)[0]

    def speak_words(self, text: str, voice: Voice) -> tuple[np.ndarray, list[tuple[int, float]]]:
        """Samples, and (character index, start in seconds) of each word as eSpeak NG placed it."""
        with self._lock:
            lib = self._lib
            if lib.espeak_SetVoiceByName(voice.full_name.encode()) != _EE_OK:
                raise ValueError(f"eSpeak NG has no voice {voice.full_name!r}")
            lib.espeak_SetParameter(_RATE, voice.rate_wpm, 0)
            lib.espeak_SetParameter(_PITCH, voice.pitch, 0)
            lib.espeak_SetParameter(_RANGE, 50, 0)
            self._chunks, self._words = [], []
            raw = text.encode("utf-8") + b"\0"
            status = lib.espeak_Synth(raw, len(raw), 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8, None, None)
            if status != _EE_OK:
                raise RuntimeError(f"eSpeak NG could not render a turn (status {status})")
            lib.espeak_Synchronize()
            samples = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            words = [(char, ms / 1000.0) for char, ms in self._words]
        return samples.astype(np.float32) / 32768.0, words
