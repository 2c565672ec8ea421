"""``--provider``: execution provider names and options, and the one-line errors when an EP is missing."""

from __future__ import annotations

import onnxruntime
import pytest

from m3export.cli import main
from m3export.errors import BackendUnavailable
from m3export.plugins.onnxruntime.providers import PACKAGES, SHORT_NAMES, Provider, parse_provider, require

AVAILABLE = set(onnxruntime.get_available_providers())


@pytest.mark.parametrize("spec, name, options", [
    ("cpu", "CPUExecutionProvider", {}),
    ("CUDA", "CUDAExecutionProvider", {}),
    ("cuda:device_id=1, gpu_mem_limit=2147483648", "CUDAExecutionProvider",
     {"device_id": "1", "gpu_mem_limit": "2147483648"}),
    ("TensorrtExecutionProvider:trt_fp16_enable=1", "TensorrtExecutionProvider", {"trt_fp16_enable": "1"}),
    ("migraphx", "MIGraphXExecutionProvider", {}),
    (["CPUExecutionProvider"], "CPUExecutionProvider", {}),
    ([("CUDAExecutionProvider", {"device_id": 2}), "CPUExecutionProvider"], "CUDAExecutionProvider",
     {"device_id": "2"}),
])
def test_provider_specs(spec, name, options):
    p = parse_provider(spec)
    assert (p.name, p.options) == (name, options)
    assert parse_provider(str(p)) == p  # the string form round-trips (triton-repo stores it)


def test_where_tensors_live():
    assert parse_provider("cpu").device == "cpu"
    assert parse_provider("openvino").device == "cpu"  # an EP that takes host tensors
    assert parse_provider("cuda").device == "cuda:0"
    assert parse_provider("cuda:device_id=3").device == "cuda:3"
    assert parse_provider("openvino").session_providers() == ["OpenVINOExecutionProvider", "CPUExecutionProvider"]
    assert parse_provider("cpu").session_providers() == ["CPUExecutionProvider"]


def test_cuda_sessions_compute_fp32_in_fp32_unless_told():
    """ORT's CUDA EP defaults use_tf32 to 1 (fp32 GEMMs at TF32's 10-bit mantissa: the ~1e-3 the first H200 run
    measured on an fp32 artifact); every session this project opens on it says use_tf32=0, the user's own
    option wins, and other EPs get nothing they did not ask for."""
    from m3export.plugins.onnxruntime.streams import session_providers

    assert parse_provider("cuda").session_providers() == [("CUDAExecutionProvider", {"use_tf32": "0"}),
                                                          "CPUExecutionProvider"]
    assert parse_provider("cuda:device_id=1").session_providers()[0] == (
        "CUDAExecutionProvider", {"use_tf32": "0", "device_id": "1"})
    assert parse_provider("cuda:use_tf32=1").session_providers()[0][1] == {"use_tf32": "1"}
    assert session_providers(parse_provider("cuda"), 7)[0][1]["use_tf32"] == "0"  # the shared-stream path too
    assert session_providers(parse_provider("cuda:use_tf32=1"), 7)[0][1]["use_tf32"] == "1"
    assert parse_provider("tensorrt").session_providers() == ["TensorrtExecutionProvider", "CPUExecutionProvider"]


def test_every_short_name_is_an_ort_name_or_has_a_package():
    known = set(onnxruntime.get_all_providers())
    assert all(full in known or full in PACKAGES for full in SHORT_NAMES.values())


@pytest.mark.parametrize("spec, match", [
    ("cdua", "unknown execution provider 'cdua': use one of .*cuda"),
    ("cuda:device_id", "option 'device_id' .* expected key=value"),
])
def test_bad_specs_are_one_clear_error(spec, match):
    with pytest.raises(BackendUnavailable, match=match):
        parse_provider(spec)


@pytest.mark.parametrize("name", sorted(set(PACKAGES) - AVAILABLE))
def test_missing_provider_names_its_package(name):
    with pytest.raises(BackendUnavailable) as e:
        require(Provider(name))
    assert "\n" not in str(e.value) and PACKAGES[name] in str(e.value) and onnxruntime.__version__ in str(e.value)


@pytest.mark.skipif("CUDAExecutionProvider" in AVAILABLE, reason="this onnxruntime has the CUDA EP")
def test_cli_verify_without_the_ep_is_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path), "--provider", "cuda"]) == 2  # checked before the artifact is read
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "install onnxruntime-gpu" in err


def test_cli_provider_needs_the_onnxruntime_backend(tmp_path, capsys):
    assert main(["generate", "tiny", "--prompt-ids", "1,2", "--provider", "cpu"]) == 2
    assert "add --backend onnxruntime" in capsys.readouterr().err
    assert main(["triton-repo", "tiny", "--out", str(tmp_path / "repo"), "--provider", "cpu"]) == 2
    assert "add --backend onnxruntime" in capsys.readouterr().err
    assert main(["triton-repo", "tiny", "--out", str(tmp_path / "repo"), "--backend", "onnxruntime",
                 "--provider", "nope"]) == 2
    assert "unknown execution provider 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()
