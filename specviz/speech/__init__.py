"""The speech task: Whisper read from CTranslate2 files, audio decoding and resampling, the self-speculative
layer draft, and clips as sequences of the shared driver.

Imports models/, decoding/ and the top-level modules.
"""
