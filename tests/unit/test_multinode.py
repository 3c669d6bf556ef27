"""Hostfile reading, the launcher flags of both multi-node modes, and naming the node a lost
connection points to (chatrl.distributed.multinode), without starting a job."""

import pytest

from chatrl.distributed import multinode


def _hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_hostfile_order_slots_and_global_ranks(tmp_path):
    path = _hostfile(tmp_path, "# comment\nworker-0 slots=8\n\nworker-1 slots=8\nworker-2 slots=4\n")
    hosts = multinode.read_hostfile(path)
    assert hosts == {"worker-0": 8, "worker-1": 8, "worker-2": 4}
    ranks = multinode.global_ranks(hosts)
    assert ranks["worker-0"] == list(range(8)) and ranks["worker-1"] == list(range(8, 16))
    assert ranks["worker-2"] == [16, 17, 18, 19]


@pytest.mark.parametrize("text, words", [
    ("a slots=2\na slots=2\n", "multiple entries for a"),
    ("a slots=2\nb\n", "bad entry: b"),
    ("# nothing\n", "empty"),
])
def test_bad_hostfile_names_the_file(tmp_path, text, words):
    path = _hostfile(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        multinode.read_hostfile(path)
    assert str(path) in str(e.value) and words in str(e.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        multinode.read_hostfile(tmp_path / "nope")


def test_launcher_flags_ssh_and_no_ssh_modes(tmp_path):
    path = _hostfile(tmp_path, "n0 slots=1\nn1 slots=1\n")
    assert multinode.launcher_flags(path, None, None) == ["--hostfile", str(path)]
    assert multinode.launcher_flags(path, None, "10.0.0.1") == ["--hostfile", str(path), "--master_addr", "10.0.0.1"]
    # no-ssh mode: the first host runs global rank 0 and is the default master address
    assert multinode.launcher_flags(path, 1, None) == ["--hostfile", str(path), "--master_addr", "n0", "--no_ssh",
                                                       "--node_rank", "1"]
    assert multinode.launcher_flags(path, 0, "127.0.0.1")[-5:] == ["--master_addr", "127.0.0.1", "--no_ssh",
                                                                  "--node_rank", "0"]
    with pytest.raises(SystemExit, match="--node-rank 2: .* lists 2 nodes"):
        multinode.launcher_flags(path, 2, None)


def test_lost_peer_names_the_other_node():
    two = {"node0": 1, "node1": 1}
    gloo = ("chatrl: rank 0 failed in step 1 (SFT) after optimizer step 2 on node 0 of 2 (vm): RuntimeError: "
            "Read error [127.0.0.1]:60616: Connection reset by peer. This is typically caused by")
    assert multinode.lost_peer([gloo], two, 0) == ("lost the connection to 127.0.0.1: node1 (node 1, global rank 1) "
                                                   "has stopped (killed, crashed or unreachable)")
    assert "node0 (node 0, global rank 0) has stopped" in multinode.lost_peer(
        ["Connection closed by peer [127.0.0.1]:5"], two, 1)
    # more nodes: those whose address matches, else every other node
    three = {"127.0.0.1": 8, "192.0.2.7": 8, "192.0.2.8": 8}
    line = "RuntimeError: Connection closed by peer [192.0.2.8]:4411"
    assert multinode.lost_peer([line], three, 0).endswith("192.0.2.8 (node 2, global ranks 16–23) has stopped "
                                                          "(killed, crashed or unreachable)")
    assert "one of the other nodes" in multinode.lost_peer(["Connection closed by peer [198.51.100.1]:1"], three, 0)
    assert multinode.lost_peer(["RuntimeError: Broken pipe"], two, 0) == (
        "lost the connection to another node: node1 (node 1, global rank 1) has stopped (killed, crashed or unreachable)")
    assert multinode.lost_peer(["local rank 0 exited with code 1"], two, 0) is None
