"""pagedkv inside vLLM: a `vllm.general_plugins` entry point that shadows vLLM's KV cache
manager or replaces it with pagedkv's.

Off unless `PAGEDKV_VLLM` says otherwise (`pagedkv.vllm_plugin.settings` lists every
variable):

    PAGEDKV_VLLM=shadow   vLLM's manager serves; every call is mirrored to pagedkv and
                          compared; a divergence is logged once with a trace that
                          `pagedkv verify --replay-trace FILE` replays, counted, and fatal
                          only with PAGEDKV_VLLM_STRICT=1
    PAGEDKV_VLLM=replace  pagedkv's manager serves vLLM's scheduler (`facade`)

`register()` imports vLLM only when a mode is set, and never installs vLLM or anything else:
the plugin works inside whichever vLLM build is installed, of a release it knows
(`settings.SUPPORTED_RELEASES`).
"""

from __future__ import annotations

import os

from .settings import Mode, Settings


def register() -> None:
    """vLLM's plugin hook, called once per process that loads general plugins.

    Raises:
        PluginSettingError: a plugin variable holds a value it does not know.
        UnsupportedReleaseError: replace mode on a vLLM release it does not know.
    """
    settings = Settings.from_environ(os.environ)
    if settings.mode is Mode.OFF:
        return
    from .install import install

    install(settings)
