"""Start-up cost of the CLI: networkx off the ``suggest`` path, lazy command loading.

The routing now reads a plain-data copy of the node graph (``NodeFabric``); these tests pin
that it gives exactly what the networkx graph gave, for every built-in profile, a few
synthetic fabrics with tied routes, and every group shape that tiles a node.
"""

from __future__ import annotations

import json
import subprocess
import sys

import networkx as nx
import pytest

from planner.hardware.cluster import Cluster, node_fabric
from planner.hardware.load import list_profiles, load_profile, profile_from_dict
from planner.hardware.routing import IntraRoutes, intra_routes, path_kinds
from planner.resources import hardware_profiles_dir


def _variant(base: str, **intra) -> object:
    """A built-in profile with some ``node.intra`` fields changed (shapes no built-in has)."""
    import yaml

    data = yaml.safe_load((hardware_profiles_dir() / f"{base}.yaml").read_text())
    data["name"] = f"{base}-variant"
    data["node"]["intra"].update(intra)
    return profile_from_dict(data)


def _profiles() -> list:
    builtins = [load_profile(name) for name in list_profiles()]
    variants = [
        _variant("mi300x", links_per_gpu=3),  # sparse circulant mesh: multi-hop routes with ties
        _variant("mi300x", links_per_gpu=4),
        _variant("mi250x", links_per_gpu=2),  # a ring
        _variant("l40s-pcie", gpus_per_pcie_switch=4),  # two switches, one per socket
        _variant("l40s-pcie", gpus_per_pcie_switch=1),  # eight switches over two sockets
    ]
    return builtins + variants


PROFILES = _profiles()


def _shapes(gpus: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every (size, stride) layout whose groups tile one node, as local index groups."""
    shapes = []
    for size in range(1, gpus + 1):
        for stride in range(1, gpus + 1):
            span = size * stride
            if gpus % span:
                continue
            groups = [tuple(b + o + j * stride for j in range(size))
                      for b in range(0, gpus, span) for o in range(stride)]
            shapes.append(tuple(groups))
    return shapes


def _reference(g: nx.Graph, groups: tuple[tuple[int, ...], ...]) -> IntraRoutes:
    """The routing as it was computed on the networkx graph (nx.shortest_path), kept as the oracle."""
    gpus = [v for v, role in g.nodes(data="role") if role == "gpu"]
    paths = {s: {d: nx.shortest_path(g, s, d) for d in gpus} for s in gpus}
    mesh = not any(role in ("nvswitch", "pcie_switch") for _, role in g.nodes(data="role"))
    size = len(groups[0])
    if size < 2:
        return IntraRoutes(float("inf"), float("inf"), 0.0, "")
    ring: dict = {}
    a2a: dict = {}

    def add(flows: dict, path: list[str]) -> None:
        for u, v in zip(path, path[1:]):
            flows[(u, v)] = flows.get((u, v), 0.0) + 1.0

    for members in groups:
        names = [f"n0.gpu{i}" for i in members]
        for k, src in enumerate(names):
            add(ring, paths[src][names[(k + 1) % size]])
            for dst in names:
                if dst != src:
                    add(a2a, paths[src][dst])
    ring_bw, edge = float("inf"), ""
    for (u, v), count in ring.items():
        share = g.edges[u, v]["bw"] / count
        if share < ring_bw:
            ring_bw, edge = share, f"{u}->{v}"
    p2p_bw = ring_bw
    if mesh:
        src = f"n0.gpu{groups[0][0]}"
        direct = [g.edges[src, f"n0.gpu{i}"]["bw"] for i in groups[0][1:] if g.has_edge(src, f"n0.gpu{i}")]
        ring_bw = max(ring_bw, sum(direct)) if direct else ring_bw
        nxt = f"n0.gpu{groups[0][1]}"
        p2p_bw = g.edges[src, nxt]["bw"] if g.has_edge(src, nxt) else p2p_bw
    a2a_spb = max(load / g.edges[u, v]["bw"] for (u, v), load in a2a.items())
    return IntraRoutes(ring_bw, p2p_bw, a2a_spb, edge)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_fabric_is_the_networkx_node_graph(profile):
    cluster = Cluster.build(profile, 1)
    g, fabric = cluster.node_graph, cluster.node_fabric
    assert list(fabric.nodes.items()) == list(g.nodes(data=True))
    assert list(fabric.edges()) == list(g.edges(data=True))
    for v in g:
        assert list(fabric.adj[v]) == list(g.adj[v])
    gpus = fabric.with_role("gpu")
    assert len(gpus) == profile.node.gpus
    for s in gpus:
        for d in gpus:
            assert fabric.shortest_path(s, d) == nx.shortest_path(g, s, d)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_routes_identical_to_networkx(profile):
    cluster = Cluster.build(profile, 1)
    key = profile.model_dump_json()
    shapes = _shapes(profile.node.gpus)
    assert len(shapes) >= (4 if profile.node.gpus >= 4 else 3)  # cpu-local has 2 ranks: 3 shapes
    for groups in shapes:
        assert intra_routes(key, groups) == _reference(cluster.node_graph, groups), (profile.name, groups)


def test_routes_in_real_numbers():
    """The identity above is not vacuous: contention shows in the results."""
    pcie = load_profile("l40s-pcie")
    key = pcie.model_dump_json()
    pair = intra_routes(key, ((0, 1), (2, 3), (4, 5), (6, 7)))
    cross = intra_routes(key, ((0, 4), (1, 5), (2, 6), (3, 7)))
    assert cross.ring_bw < pair.ring_bw
    assert "socket" in path_kinds(key, (0, 4)) and "socket" not in path_kinds(key, (0, 1))
    assert node_fabric(key).shortest_path("n0.gpu0", "n0.gpu4") == [
        "n0.gpu0", "n0.pcie0", "n0.cpu0", "n0.cpu1", "n0.pcie2", "n0.gpu4"]


def test_link_counts_and_summary_unchanged():
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 4)
    kinds: dict[str, int] = {}
    for _, _, kind in cluster.node_graph.edges(data="kind"):
        kinds[kind] = kinds.get(kind, 0) + 1
    counts = cluster.link_counts()
    assert counts["nvlink"] == kinds["nvlink"] * 4 == 8 * 4
    assert counts["network"] == 4 * 8


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_suggest_never_imports_networkx():
    code = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from planner.cli import main\n"
        "r = CliRunner().invoke(main, ['suggest', '--model', 'vl2', '--nodes', '8', '--json'])\n"
        "plans = json.loads(r.output)['plans'] if r.exit_code == 0 else []\n"
        "print(json.dumps({'code': r.exit_code, 'plans': len(plans),"
        " 'nx': 'networkx' in sys.modules, 'rich_table': 'rich.table' in sys.modules}))\n"
    )
    result = _run(code)
    assert result["code"] == 0 and result["plans"] == 5
    assert result["nx"] is False
    assert result["rich_table"] is False  # --json prints no table


def test_suggest_loads_only_its_command_module():
    code = (
        "import json, sys\n"
        "from planner.cli import main\n"
        "try:\n"
        "    main(['suggest', '--model', 'vl2', '--nodes', '1', '--tp', '8', '--pp', '1', '--json'])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "print(json.dumps({'code': code, 'cli': sorted(m for m in sys.modules if m.startswith('planner.cli.'))}))\n"
    )
    result = _run(code)
    assert result["code"] == 0
    assert "planner.cli.suggest" in result["cli"]
    for other in ("models", "hardware", "topo", "estimate", "generate", "run", "plot"):
        assert f"planner.cli.{other}" not in result["cli"]


def test_help_lists_every_command_with_its_summary():
    import importlib

    from click.testing import CliRunner

    from planner.cli import COMMAND_MODULES, main

    result = CliRunner().invoke(main, ["--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    listed = result.output.split("Commands:")[1]
    for name in COMMAND_MODULES:
        (command,) = importlib.import_module(f"planner.cli.{name}").commands
        assert command.name == name
        summary = command.get_short_help_str(limit=100 - 6 - len(name))
        assert f"  {name}" in listed and summary.rstrip(".")[:30] in listed, name
    bad = CliRunner().invoke(main, ["sugest"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


# -- lean environment: OpenBLAS single-threaded, no pydantic plugin scan ---------------------

_LEAN = ("OPENBLAS_NUM_THREADS", "PYDANTIC_DISABLE_PLUGINS")


def _run_clean(code: str, **env: str) -> dict:
    """_run in a child whose environment has neither lean variable unless given."""
    import os

    child = {k: v for k, v in os.environ.items() if k not in _LEAN} | env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_suggest_skips_start_up_work_it_does_not_need():
    code = (
        "import json, os, sys\n"
        "from planner.cli import main\n"
        "try:\n"
        "    main(['suggest', '--model', 'vl2', '--nodes', '8', '--json'])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "import pydantic.plugin._loader as loader, tokenize\n"
        "print(json.dumps({'code': code, 'threads': len(os.listdir('/proc/self/task')),\n"
        "                  'tokenize_regex': tokenize._compile.cache_info().currsize,\n"
        "                  'difflib': 'difflib' in sys.modules,\n"
        "                  'numpy': 'numpy' in sys.modules, 'scanned': loader._plugins is not None,\n"
        "                  'left': [k for k in %r if k in os.environ]}))\n" % (_LEAN,)
    )
    result = _run_clean(code)
    assert result["code"] == 0 and result["numpy"]
    assert result["threads"] == 1  # OpenBLAS starts one thread per extra core unless told otherwise
    assert result["scanned"] is False  # pydantic never read the installed distributions' entry points
    assert result["left"] == []  # set for the command only: nothing leaks to what runs after it
    # no pydantic default_factory is a builtin (``list``): reading a builtin's signature compiles
    # tokenize's regex (~5 ms), and nothing else on this path needs it
    assert result["tokenize_regex"] == 0
    assert result["difflib"] is False  # only a mistyped model or profile name needs "did you mean"


def test_lean_environment_keeps_the_users_values_and_spares_run():
    code = (
        "import json, os, click\n"
        "from planner.cli import main\n"
        "seen = {}\n"
        "for name in ('run', 'probe'):\n"
        "    main.add_command(click.Command(name, callback=lambda name=name: seen.update(\n"
        "        {name: {k: os.environ.get(k) for k in %r}})))\n"
        "    try:\n"
        "        main([name])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps(seen))\n" % (_LEAN,)
    )
    seen = _run_clean(code, OPENBLAS_NUM_THREADS="4")
    assert seen["probe"] == {"OPENBLAS_NUM_THREADS": "4", "PYDANTIC_DISABLE_PLUGINS": "__all__"}
    # the training job that ``run`` starts inherits the environment: it gets the user's, untouched
    assert seen["run"] == {"OPENBLAS_NUM_THREADS": "4", "PYDANTIC_DISABLE_PLUGINS": None}


# -- hardware profiles parsed by libyaml, with PyYAML's own words for broken files ----------

_TRICKY_YAML = [
    "a: &base {x: 1, y: [1, 2.5, 3e2, 1.0e+3, .inf, 0x1F, 0o17, 017, 1_000]}\nb: *base\nc: [*base, null]\n",
    ("s: 'it''s'\nt: \"tab\\tand \\u00e9\"\nu: |\n  two\n  lines\n"
     "v: >-\n  folded\n  text\nw: ~\nx: yes\ny: Off\nz: 2024-01-02\n"),
    "name: h\u00e9llo w\u00f6rld \u2014 \U0001F680\n'quoted key': [a, 'b', \"c\"]\n? complex\n: value\n",
    "nested:\n  - {a: 1}\n  - - x\n    - y\n  -\n    k: v\n",
    "a: &base {x: 1, y: 2}\nb:\n  <<: *base\n  y: 3\n",  # merge keys; a key given here overrides the merged one
]

_BROKEN_YAML = [
    "name: x\ngpu: {name: [unclosed\n",
    "name: x\nname: y\n",
    "a: 1\n b: 2\n",
    "a: [1, 2\nb: 3\n",
    "key: value: other\n",
    "\tname: tab\n",
    "a: !!python/object:os.system 1\n",
    "a: &base {x: 1}\nb:\n  <<: *base\n  y: 2\n  y: 3\n",  # a duplicate beside a merge key
]


def test_profiles_are_parsed_by_libyaml_exactly_as_by_pyyaml():
    import yaml

    from planner.hardware import load

    assert load._FastUniqueKeyLoader is not None  # this PyYAML has libyaml: the fast path is the one tested
    texts = [p.read_text() for p in sorted(hardware_profiles_dir().glob("*.yaml"))] + _TRICKY_YAML
    assert len(texts) >= 9 + len(_TRICKY_YAML)
    for text in texts:
        slow = yaml.load(text, Loader=load._UniqueKeyLoader)  # noqa: S506
        fast = yaml.load(text, Loader=load._FastUniqueKeyLoader)  # noqa: S506
        assert fast == slow and repr(fast) == repr(slow)  # same values and the same types


@pytest.mark.parametrize("text", _BROKEN_YAML)
def test_broken_yaml_is_described_in_pyyaml_words(tmp_path, text):
    import yaml

    from planner.errors import UserError
    from planner.hardware import load

    with pytest.raises(yaml.YAMLError) as slow:
        yaml.load(text, Loader=load._UniqueKeyLoader)  # noqa: S506
    mark = slow.value.problem_mark
    expected = f"malformed YAML (line {mark.line + 1}, column {mark.column + 1}): {slow.value.problem}"
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load.load_profile_file(path)
    assert str(err.value) == f"{path}: {expected}"
