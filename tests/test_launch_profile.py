"""Launch profiles: each rank's vllm serve argv (golden), the profile key (recomputed by hand
from README's serialization), `launch argv` through the CLI, vLLM 0.30.0's own parser reading
the rendered argv back, and the bad-profile corpus (tests/bad_profiles/)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from builder import api, launch
from builder.cli import main
from builder.errors import InputError
from builder.schema import _Field
from tests.helpers import snapshot
from tools.synthetic import DEFAULT_RECIPE, ROOT

DEFAULT_PROFILE = ROOT / "recipes" / "launch" / "v41-sm120.yaml"
CORPUS = Path(__file__).parent / "bad_profiles"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
CASE_FILES = {"profile.yaml", "expected", "rank"}

HEAD = [
    "vllm", "serve", "/models/DeepSeek-V4.1",
    "--served-model-name", "deepseek-ai/DeepSeek-V4.1",
    "--tensor-parallel-size", "4",
    "--gpu-memory-utilization", "0.9",
    "--max-model-len", "65536",
    "--language-model-only",
    "--hf-overrides.vision_n_layers", "0",
    "--nnodes", "2", "--node-rank", "0", "--master-addr", "sm120-a.internal", "--master-port", "29501",
]  # fmt: skip
WORKER = HEAD[:-6] + ["--node-rank", "1", "--master-addr", "sm120-a.internal", "--master-port", "29501", "--headless"]

# Every kind of value, on flags vLLM 0.30.0 really has (test_vllm_reads_the_argv_back parses it).
KINDS = """\
name: kinds
recipe: ../v41-sm120.yaml
checkpoint: /srv/models/DeepSeek V4.1 (text only)
served_model_name: v41-text
parallel: {tensor_parallel_size: 2, pipeline_parallel_size: 2, data_parallel_size: 1}
engine_args:
  max-num-seqs: 8
  gpu-memory-utilization: 0.85
  kv-cache-dtype: fp8
  enforce-eager: true
  no-enable-prefix-caching: true
  cudagraph-capture-sizes: [1, 2, 4]
  compilation-config: {mode: 3}
  api-key: -secret.key
  seed: -1
requests:
  hf_overrides:
    vision_n_layers: 0
    layer_ids: [1, 2]
    rope_scaling: {type: yarn, factor: 4.0}
    torch_dtype: bfloat16
    max_size: 80g
    flag_text: "true"
    zero_text: "0"
    nan_text: NaN
    dash_text: -x_y.z
    spaced: a b
    accent: é
    ratio: 1.5
    nothing: null
    enabled: true
    dotted: a.b
  modality: LanguageModelOnly
ranks:
  - {name: head, engine: "unix:///run/vllm-overlay/docker.sock", gpus: [], node_rank: 0,
     master_addr: 127.0.0.1, master_port: 29501}
  - {name: worker, engine: "tcp://127.0.0.1:2376", gpus: [2, 3], node_rank: 1,
     master_addr: 127.0.0.1, master_port: 29501, headless: true}
"""
KINDS_HEAD = [
    "vllm", "serve", "/srv/models/DeepSeek V4.1 (text only)",
    "--served-model-name", "v41-text",
    "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--data-parallel-size", "1",
    # engine arguments, sorted by flag; a value that starts with '-' joined with '='
    "--api-key=-secret.key",
    "--compilation-config", '{"mode":3}',
    "--cudagraph-capture-sizes", "1", "2", "4",
    "--enforce-eager",
    "--gpu-memory-utilization", "0.85",
    "--kv-cache-dtype", "fp8",
    "--max-num-seqs", "8",
    "--no-enable-prefix-caching",
    "--seed=-1",
    # requests in REQUESTS order (modality, then hf_overrides), whatever the profile's order
    "--language-model-only",
    "--hf-overrides.accent", '"\\u00e9"',
    "--hf-overrides.dash_text", '"-x_y.z"',
    "--hf-overrides.dotted", "a.b",
    "--hf-overrides.enabled", "true",
    "--hf-overrides.flag_text", '"true"',
    "--hf-overrides.layer_ids", "[1,2]",
    "--hf-overrides.max_size", '"80g"',
    "--hf-overrides.nan_text", '"NaN"',
    "--hf-overrides.nothing", "null",
    "--hf-overrides.ratio", "1.5",
    "--hf-overrides.rope_scaling", '{"factor":4.0,"type":"yarn"}',
    "--hf-overrides.spaced", '"a b"',
    "--hf-overrides.torch_dtype", "bfloat16",
    "--hf-overrides.vision_n_layers", "0",
    "--hf-overrides.zero_text", '"0"',
    "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29501",
]  # fmt: skip
KINDS_OVERRIDES = {
    "vision_n_layers": 0,
    "layer_ids": [1, 2],
    "rope_scaling": {"type": "yarn", "factor": 4.0},
    "torch_dtype": "bfloat16",
    "max_size": "80g",
    "flag_text": "true",
    "zero_text": "0",
    "nan_text": "NaN",
    "dash_text": "-x_y.z",
    "spaced": "a b",
    "accent": "é",
    "ratio": 1.5,
    "nothing": None,
    "enabled": True,
    "dotted": "a.b",
}


def write_profile(tmp: Path, text: str, name: str = "profile.yaml") -> Path:
    """``text`` as tmp/p/<name>, beside a copy of the default recipe at tmp/v41-sm120.yaml."""
    shutil.copy(DEFAULT_RECIPE, tmp / "v41-sm120.yaml")
    (tmp / "p").mkdir(exist_ok=True)
    path = tmp / "p" / name
    path.write_text(text, encoding="utf-8")
    return path


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- argv


def test_default_profile_argv_of_each_rank():
    assert api.launch_argv(DEFAULT_PROFILE, "head") == HEAD
    assert api.launch_argv(DEFAULT_PROFILE, "worker") == WORKER


def test_default_profile_makes_the_text_only_request():
    profile = api.load_profile(DEFAULT_PROFILE)
    assert profile.recipe.name == "v41-sm120"  # its recipe, named relative to the profile
    assert profile.recipe_path.resolve() == DEFAULT_RECIPE.resolve()
    for rank in ("head", "worker"):
        argv = api.launch_argv(profile, rank)
        assert argv[:3] == ["vllm", "serve", "/models/DeepSeek-V4.1"]
        at = argv.index("--language-model-only")
        assert argv[at + 1 : at + 3] == ["--hf-overrides.vision_n_layers", "0"]


def test_every_kind_of_value_renders(tmp_path):
    path = write_profile(tmp_path, KINDS)
    assert api.launch_argv(path, "head") == KINDS_HEAD
    worker = api.launch_argv(path, "worker")
    assert worker == KINDS_HEAD[:-6] + ["--node-rank", "1"] + KINDS_HEAD[-4:] + ["--headless"]


def test_a_single_rank_renders_no_multi_node_flags(tmp_path):
    path = write_profile(
        tmp_path,
        "name: one\nrecipe: ../v41-sm120.yaml\ncheckpoint: /m\nserved_model_name: m\n"
        "parallel: {tensor_parallel_size: 4}\nranks: [{name: solo, engine: 'ssh://gpu-a:2222', gpus: [0, 1, 2, 3]}]\n",
    )
    assert api.launch_argv(path, "solo") == [
        "vllm", "serve", "/m", "--served-model-name", "m", "--tensor-parallel-size", "4",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        (0, "0"),
        (-3, "-3"),
        (2.5e-05, "2.5e-05"),
        (True, "true"),
        (None, "null"),
        ([1, "a", None], '[1,"a",null]'),
        ({"b": [1], "a": {"c": "d"}}, '{"a":{"c":"d"},"b":[1]}'),
        ("bfloat16", "bfloat16"),
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
        ("", '""'),
        ("1", '"1"'),
        ("1.5", '"1.5"'),
        ("25.6k", '"25.6k"'),
        ("null", '"null"'),
        ("Infinity", '"Infinity"'),
        ("-1", '"-1"'),
        ("--headless", '"--headless"'),
        ("a\nb", '"a\\nb"'),
        ('{"x": 1}', '"{\\"x\\": 1}"'),
    ],
)
def test_override_values_render_as_vllm_reads_them(value, rendered):
    assert launch.render_override_value(value) == rendered


# ---------------------------------------------------------------- the profile key


# The default profile's key material, written out by hand from README's "The profile key".
DEFAULT_MATERIAL = """\
vllm-overlay-profile-key 1
checkpoint "/models/DeepSeek-V4.1"
served-model-name "deepseek-ai/DeepSeek-V4.1"
parallel tensor_parallel_size 4
engine-arg gpu-memory-utilization 0.9
engine-arg max-model-len 65536
request modality "LanguageModelOnly"
request hf_overrides {"vision_n_layers":0}
rank head {"engine":"ssh://vllm@sm120-a.internal","gpus":[0,1],"master_addr":"sm120-a.internal","master_port":29501,"node_rank":0}
rank worker {"engine":"ssh://vllm@sm120-b.internal","gpus":[0,1],"headless":true,"master_addr":"sm120-a.internal","master_port":29501,"node_rank":1}
"""
# == "pk-" + sha(DEFAULT_MATERIAL), pinned so a change of the format or the default profile is seen
DEFAULT_GOLDEN = "pk-7dc0d22ba151fa94c9d632643796e738845238df804a8fa6853a8e9be51ce378"

PLAIN = """\
name: plain
recipe: ../v41-sm120.yaml
checkpoint: /models/v41
served_model_name: v41
parallel: {tensor_parallel_size: 4}
ranks: [{name: solo, engine: "unix:///run/docker.sock", gpus: []}]
"""
PLAIN_MATERIAL = """\
vllm-overlay-profile-key 1
checkpoint "/models/v41"
served-model-name "v41"
parallel tensor_parallel_size 4
rank solo {"engine":"unix:///run/docker.sock","gpus":[]}
"""


def test_default_profile_key_is_recomputed_by_hand():
    assert "pk-" + sha(DEFAULT_MATERIAL) == DEFAULT_GOLDEN
    assert api.profile_key(DEFAULT_PROFILE) == DEFAULT_GOLDEN
    assert launch.key_material(api.load_profile(DEFAULT_PROFILE)) == DEFAULT_MATERIAL.encode()


def test_a_profile_without_requests_has_no_request_lines(tmp_path):
    assert api.profile_key(write_profile(tmp_path, PLAIN)) == "pk-" + sha(PLAIN_MATERIAL)
    # an empty requests mapping makes no request either
    assert api.profile_key(write_profile(tmp_path, PLAIN + "requests: {}\n", "empty.yaml")) == "pk-" + sha(
        PLAIN_MATERIAL
    )


class _Quantized:
    """A request type that does not exist yet: what adding one looks like."""

    kind = "quantization"

    def __init__(self, value):
        self.value = value

    def argv(self):
        return ["--quantization", self.value]

    def material(self):
        return self.value


def test_adding_a_request_type_keeps_the_key_of_profiles_that_do_not_make_it(tmp_path, monkeypatch):
    plain, default = write_profile(tmp_path, PLAIN), DEFAULT_PROFILE
    before = {p: (api.profile_key(p), api.launch_argv(p, api.load_profile(p).ranks[0].name)) for p in (plain, default)}
    monkeypatch.setitem(launch.REQUESTS, "quantization", _Field(lambda where, v: _Quantized(v), required=False))
    for p in (plain, default):
        assert (api.profile_key(p), api.launch_argv(p, api.load_profile(p).ranks[0].name)) == before[p]
    # a profile that makes the new request gets its line, and only that line more
    made = write_profile(tmp_path, PLAIN + "requests: {quantization: fp8}\n", "made.yaml")
    lines = PLAIN_MATERIAL.splitlines(keepends=True)
    assert api.profile_key(made) == "pk-" + sha("".join(lines[:4] + ['request quantization "fp8"\n'] + lines[4:]))
    assert api.launch_argv(made, "solo")[-2:] == ["--quantization", "fp8"]


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (("/models/v41", "/models/v42"), "checkpoint"),
        (("served_model_name: v41", "served_model_name: v41b"), "served name"),
        (("{tensor_parallel_size: 4}", "{tensor_parallel_size: 4, data_parallel_size: 1}"), "a parallel size set"),
        (("gpus: []", "gpus: [0, 1, 2, 3]"), "GPUs"),
        (("unix:///run/docker.sock", "unix:///run/docker2.sock"), "engine"),
        (("ranks:", "engine_args: {enforce-eager: true}\nranks:"), "an engine argument"),
        (("ranks:", "requests: {hf_overrides: {vision_n_layers: 0}}\nranks:"), "a request"),
    ],
)
def test_the_key_changes_with_what_is_launched(tmp_path, edit, what):
    changed = write_profile(tmp_path, PLAIN.replace(*edit), "changed.yaml")
    assert api.profile_key(changed) != api.profile_key(write_profile(tmp_path, PLAIN)), what


def test_the_key_ignores_name_recipe_path_and_yaml_spelling(tmp_path):
    respelled = (
        "# a comment\nranks:\n  - gpus: []\n    engine: unix:///run/docker.sock\n    name: solo\n"
        "parallel:\n  tensor_parallel_size: 4\nserved_model_name: 'v41'\ncheckpoint: \"/models/v41\"\n"
        "recipe: ../p/../v41-sm120.yaml\nname: other-name\n"
    )
    assert api.profile_key(write_profile(tmp_path, respelled, "respelled.yaml")) == "pk-" + sha(PLAIN_MATERIAL)


def test_readme_shows_the_default_profile_and_its_material():
    """README's "Launch" shows the default profile (as YAML that loads to the same data) and its
    key material, verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    launch_section = readme.split("\n## Launch\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:yaml)?\n(.*?)```", launch_section, re.S)
    assert yaml.safe_load(blocks[0]) == yaml.safe_load(DEFAULT_PROFILE.read_text())
    assert DEFAULT_MATERIAL in blocks
    assert DEFAULT_GOLDEN in launch_section


# ---------------------------------------------------------------- the CLI


def test_launch_argv_through_the_cli(capsys):
    assert main(["launch", "argv", str(DEFAULT_PROFILE), "--rank", "worker"]) == 0
    out, err = capsys.readouterr()
    assert out == shlex.join(WORKER) + "\n" and err == ""
    assert main(["launch", "argv", str(DEFAULT_PROFILE), "--rank", "head", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out) == HEAD


def test_launch_argv_quotes_for_the_shell(tmp_path, capsys):
    path = write_profile(tmp_path, KINDS)
    assert main(["launch", "argv", str(path), "--rank", "head"]) == 0
    out, _ = capsys.readouterr()
    assert shlex.split(out) == KINDS_HEAD
    assert "'/srv/models/DeepSeek V4.1 (text only)'" in out
    assert '--hf-overrides.rope_scaling \'{"factor":4.0,"type":"yarn"}\'' in out


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--rank", "tail"], f"{DEFAULT_PROFILE}: --rank: unknown rank 'tail' (the profile's ranks: head, worker)"),
        ([], "launch argv: the following arguments are required: --rank (see vllm-overlay launch argv --help)"),
    ],
)
def test_launch_argv_refuses_in_one_line(argv, line, capsys):
    assert main(["launch", "argv", str(DEFAULT_PROFILE), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"vllm-overlay: {line}\n"


def test_an_unknown_rank_is_an_input_error():
    with pytest.raises(InputError) as info:
        api.launch_argv(DEFAULT_PROFILE, "Head")
    assert info.value.fields() == {"file": str(DEFAULT_PROFILE), "field": "--rank"}


# ---------------------------------------------------------------- vLLM reads it back


READ_BACK = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for argv in json.load(sys.stdin):
    assert argv[:2] == ["vllm", "serve"], argv
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv[2:])
    names = ["model_tag", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size",
             "data_parallel_size", "api_key", "cudagraph_capture_sizes", "enforce_eager",
             "gpu_memory_utilization", "kv_cache_dtype", "max_num_seqs", "enable_prefix_caching", "seed",
             "language_model_only", "hf_overrides", "nnodes", "node_rank", "master_addr", "master_port",
             "headless", "max_model_len"]
    got = {name: getattr(args, name) for name in names}
    got["compilation_mode"] = args.compilation_config.mode
    out.setdefault("parsed", []).append(got)
print(json.dumps(out))
"""


def test_vllm_reads_the_argv_back(probe_python, tmp_path):
    """vLLM 0.30.0's own serve parser (with its dotted-flag pass) gives back every value the
    profile wrote: the argv means what the profile says."""
    kinds = write_profile(tmp_path, KINDS)
    argvs = [api.launch_argv(kinds, "head"), api.launch_argv(kinds, "worker")]
    argvs += [api.launch_argv(DEFAULT_PROFILE, "head"), api.launch_argv(DEFAULT_PROFILE, "worker")]
    proc = subprocess.run(
        [str(probe_python), "-c", READ_BACK],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_STREAM": "ext://sys.stderr", "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, worker, default_head, default_worker = json.loads(proc.stdout)["parsed"]
    assert head == {
        "model_tag": "/srv/models/DeepSeek V4.1 (text only)",
        "served_model_name": ["v41-text"],
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 1,
        "api_key": ["-secret.key"],
        "cudagraph_capture_sizes": [1, 2, 4],
        "enforce_eager": True,
        "gpu_memory_utilization": 0.85,
        "kv_cache_dtype": "fp8",
        "max_num_seqs": 8,
        "enable_prefix_caching": False,
        "seed": -1,
        "language_model_only": True,
        "hf_overrides": KINDS_OVERRIDES,
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": 29501,
        "headless": False,
        "max_model_len": None,
        "compilation_mode": 3,
    }
    assert worker == {**head, "node_rank": 1, "headless": True}
    assert default_head["hf_overrides"] == {"vision_n_layers": 0} and default_head["language_model_only"] is True
    assert (default_head["tensor_parallel_size"], default_head["nnodes"], default_head["max_model_len"]) == (
        4,
        2,
        65536,
    )
    assert (default_head["headless"], default_worker["headless"], default_worker["node_rank"]) == (False, True, 1)


# ---------------------------------------------------------------- bad profiles


def test_corpus_is_large_enough():
    assert len(CASES) >= 10
    for case in CASES:
        assert {p.name for p in (CORPUS / case).iterdir()} <= CASE_FILES, case
        assert (CORPUS / case / "profile.yaml").is_file() and (CORPUS / case / "expected").is_file(), case


@pytest.mark.parametrize("case", CASES)
def test_bad_profile(case, tmp_path, monkeypatch, capsys):
    """In this process through main(): exactly the expected line (the file, the field, what is
    wrong), exit 2, nothing on stdout, nothing written.  Run from the case's copy, so the line
    names `profile.yaml` as the user typed it; its recipe is a copy of the default one."""
    shutil.copy(DEFAULT_RECIPE, tmp_path / "v41-sm120.yaml")
    work = tmp_path / case
    shutil.copytree(CORPUS / case, work)
    rank = (work / "rank").read_text().strip() if (work / "rank").exists() else "head"
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    code = main(["launch", "argv", "profile.yaml", "--rank", rank])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err == f"vllm-overlay: {(work / 'expected').read_text().strip()}\n"
    assert snapshot(tmp_path) == before


def test_the_local_gate_profile_loads_and_names_both_local_engines(services, tmp_path):
    """`make gate-local`'s profile (tools/local_gate.py) is a valid profile on the two test
    engines, and its ranks' argv pass the text-only request to the checkpoint it wrote."""
    from tools.local_gate import write_local_gate

    path = write_local_gate(tmp_path / "gate-local")
    engines = [rank.engine for rank in api.load_profile(path).ranks]
    assert engines == [services["DOCKER_HOST"], services["VLLM_OVERLAY_TEST_DOCKER_HOST2"]]
    argv = api.launch_argv(path, "b")
    assert argv[:3] == ["vllm", "serve", str((tmp_path / "gate-local" / "v41-ratio2").resolve())]
    assert "--language-model-only" in argv and argv[-1] == "--headless"
    assert (tmp_path / "gate-local" / "v41-ratio2" / "config.json").is_file()
