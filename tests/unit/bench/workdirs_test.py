"""The bench's working folders: each names its owner, and the next bench removes those whose owner was killed."""

import json
import os
import signal
import subprocess
import sys
import textwrap

from erpo_jax.bench import workdirs

KILLED_WHILE_WRITING = textwrap.dedent("""
    import os, signal, sys
    from erpo_jax.bench import workdirs
    folder = workdirs.make("rl", sys.argv[1])
    (folder / "run").mkdir()
    (folder / "run" / "params").write_bytes(b"x" * 3 * 2**20)
    print(folder, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_benchs_folder_is_removed_by_the_next_and_live_ownerless_or_other_folders_are_kept(tmp_path, capsys):
  proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, str(tmp_path)], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == -signal.SIGKILL
  killed = tmp_path / os.path.basename(proc.stdout.strip())
  assert killed.name.startswith("erpo-bench-rl-") and (killed / "run" / "params").is_file()
  live = workdirs.make("xla", str(tmp_path))  # this process's: alive
  ownerless = tmp_path / "erpo-bench-old"  # written before folders named their owner
  ownerless.mkdir()
  other = tmp_path / "other-folder"
  other.mkdir()
  (other / workdirs.OWNER_FILE).write_text(json.dumps({"pid": 2**22 + 7, "start": None}))

  workdirs.announce_stale_removed(str(tmp_path))
  assert not killed.exists() and live.is_dir() and ownerless.is_dir() and other.is_dir()
  err = capsys.readouterr().err
  assert err == f"bench: removed 1 working folder (0.00 GiB) in {tmp_path} left by bench runs that were killed\n"
  assert workdirs.remove_stale(str(tmp_path)) == (0, 0)


def test_a_later_process_given_the_owners_id_is_not_taken_for_the_owner(tmp_path):
  reused = workdirs.make("rl", str(tmp_path))
  owner = json.dumps({"pid": os.getpid(), "start": "1"})  # this process's id, another start time
  (reused / workdirs.OWNER_FILE).write_text(owner)
  (reused / "data").write_bytes(b"y" * 2**20)
  assert workdirs.remove_stale(str(tmp_path)) == (1, 2**20 + len(owner)) and not reused.exists()


def test_a_working_folder_is_gone_after_its_block_even_when_the_block_fails(tmp_path):
  try:
    with workdirs.folder("run", str(tmp_path)) as path:
      (path / "spec.json").write_text("{}")
      raise KeyboardInterrupt
  except KeyboardInterrupt:
    pass
  assert list(tmp_path.iterdir()) == []
