"""The course's SLURM paths on a real SLURM cluster, not on stand-ins: chapter 03's
``slurm_torchrun.sbatch`` and the autograder's ``autograder/slurm/submit_grading.sh``.

The cluster is the throwaway one of ``slurm/start_local_cluster.sh``: a controller and two slurmd
"nodes" (n1, n2) on this machine, with a munge key, ports and state of its own. It needs root and
Debian's ``slurmctld slurmd slurm-client munge`` (CI installs them in ``.ci/run``); without them
every test here is skipped, with the reason. One cluster serves the module; it is stopped by pid
(``slurm/stop_local_cluster.sh``) in a ``finally``, also when a test fails, and the module then
checks that no process of it is left: every process of a cluster, from munged to a job's
workers, carries that cluster's ``SLURM_CONF`` in its environment, which is how they are found.

The jobs are kept small: the torchrun jobs run 2 nodes x 2 workers (an all-reduce of the ranks,
and chapter 01's training of a tiny model); the graded class is three students of
``11_beyond_ddp`` (four notebooks, 42 points: the kind of assignment where one notebook the grader
could not read once took the whole assignment down), built from the committed release and
solution notebooks.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from fake_class import gradebook_submissions, solved_release

from autograder import gradesheet
from autograder.__main__ import build_parser
from autograder.merge import Shard
from autograder.sources import exercises

ROOT = Path(__file__).resolve().parent.parent
START, STOP = ROOT / "slurm" / "start_local_cluster.sh", ROOT / "slurm" / "stop_local_cluster.sh"
SBATCH = ROOT / "chapters" / "03_torchrun" / "slurm_torchrun.sbatch"
SUBMIT = ROOT / "autograder" / "slurm" / "submit_grading.sh"
TWO_NODES = "chapters/03_torchrun/two_nodes.py"
DDP_RUN = "chapters/01_why_ddp/ddp_equals_single_process.py"
BIN = Path(sys.executable).parent
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo",
         "scancel")
SYSTEM_PATH = f"{BIN}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
pytestmark = pytest.mark.timeout(900)


def why_no_cluster() -> str | None:
    """Why this machine cannot start the local cluster, or None if it can."""
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurm/start_local_cluster.sh)"
    missing = [tool for tool in TOOLS if not shutil.which(tool, path=SYSTEM_PATH)]
    if missing:
        return (f"no {', '.join(missing)}: apt-get install --no-install-recommends slurmctld "
                f"slurmd slurm-client munge")
    return None


def processes_of(folder: Path) -> list[str]:
    """The live processes of the cluster in ``folder``: those whose environment holds its
    SLURM_CONF (the daemons, slurmstepd, the jobs' processes), as "pid name"."""
    mark = f"SLURM_CONF={folder / 'etc' / 'slurm.conf'}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"{proc.name} {(proc / 'comm').read_text().strip()}")
        except OSError:  # gone, or a zombie
            continue
    return found


def start(folder: Path, **settings: str) -> None:
    done = subprocess.run(["bash", str(START), str(folder)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": SYSTEM_PATH, **settings})
    if done.returncode:
        pytest.fail(f"the local cluster did not start:\n{done.stdout}\n{done.stderr}")


def stop(folder: Path, grace_s: float = 10) -> list[str]:
    """Stop the cluster in ``folder``; return whatever of it is still running ``grace_s`` later."""
    subprocess.run(["bash", str(STOP), str(folder)], capture_output=True, timeout=120,
                   env={**os.environ, "PATH": SYSTEM_PATH})
    give_up = time.monotonic() + grace_s
    while (left := processes_of(folder)) and time.monotonic() < give_up:
        time.sleep(0.2)
    return left


class Cluster:
    def __init__(self, folder: Path):
        self.folder = folder

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PATH": SYSTEM_PATH,
                "SLURM_CONF": str(self.folder / "etc" / "slurm.conf"), **extra}

    def run(self, cmd: list[str], timeout: float = 60, **extra: str) -> str:
        done = subprocess.run(cmd, cwd=ROOT, env=self.env(**extra), capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"{cmd}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job`` of a job (every task of an array), one dict per job."""
        text = self.run(["scontrol", "show", "job", "--oneliner", job_id])
        return [dict(re.findall(r"(\w[\w/:]*)=(\S*)", line)) for line in text.splitlines()
                if line.strip()]

    def wait_until_gone(self, job_ids: list[str], timeout: float) -> None:
        """Wait until none of ``job_ids`` is queued or running."""
        give_up = time.monotonic() + timeout
        while self.run(["squeue", "--noheader", "--jobs", ",".join(job_ids)]).strip():
            assert time.monotonic() < give_up, self.run(["squeue"])
            time.sleep(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The 2-node cluster for this module (8 CPUs per node: every job here runs at once)."""
    reason = why_no_cluster()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    try:
        start(folder, CPUS_PER_NODE="8")
        yield Cluster(folder)
    finally:
        left = stop(folder)
        assert not left, f"processes of the cluster still running after its stop: {left}"


def run_at_once(commands: dict[str, tuple[list[str], dict]], timeout: float) -> dict[str, str]:
    """Run the commands side by side, each in its own session; their output (stdout and stderr)
    by name. At the deadline, or on any failure here, every one still running is killed."""
    running = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
               for name, (cmd, env) in commands.items()}
    try:
        outputs = {name: p.communicate(timeout=timeout)[0] for name, p in running.items()}
    finally:
        for process in running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for name, process in running.items():
        assert process.returncode == 0, f"{name} exited with {process.returncode}:\n{outputs[name]}"
    return outputs


# --- chapter 03: slurm_torchrun.sbatch ---------------------------------------------------------

@pytest.fixture(scope="module")
def torchrun_jobs(cluster, tmp_path_factory):
    """Both forms of the batch file under ``sbatch --wait`` on 2 nodes x 2 workers (c10d on
    two_nodes.py, static on chapter 01's DDP training), and that training by torchrun on one node
    with 4 workers, all three at once."""
    out = tmp_path_factory.mktemp("torchrun")
    sbatch = ["sbatch", "--wait", "--gpus-per-node=0", "--cpus-per-task=2", "--time=10"]
    jobs = cluster.env(NPROC_PER_NODE="2")
    outputs = run_at_once({
        "c10d": (sbatch + [f"--output={out}/c10d.out", str(SBATCH), TWO_NODES], jobs),
        "static": (sbatch + [f"--output={out}/static.out", str(SBATCH), DDP_RUN],
                   {**jobs, "RDZV_MODE": "static"}),
        "one node": ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "4", DDP_RUN], cluster.env()),
    }, timeout=600)
    job_ids = {form: re.search(r"Submitted batch job (\d+)", outputs[form]).group(1)
               for form in ("c10d", "static")}
    return {form: ((out / f"{form}.out").read_text(), cluster.jobs(job_ids[form])[0])
            for form in job_ids} | {"one node": outputs["one node"]}


def training_lines(text: str) -> list[str]:
    """What chapter 01's training printed, from its first line on, without torchrun's warnings."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if re.match(r"\d+ ranks, backend ", line))
    return [line for line in lines[first:]
            if line.strip() and not re.match(r"[WI]\d{4} |\*+$|Setting OMP_NUM_THREADS", line)]


def test_the_c10d_form_makes_one_group_of_4_ranks_across_both_nodes(cluster, torchrun_jobs):
    output, job = torchrun_jobs["c10d"]
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]")
    head = re.search(r"job (\d+): 2 nodes x 2 workers, head node n1:(\d+)", output)
    assert head and head.group(1) == job["JobId"], output
    ranks = re.findall(r"node (\d) of 2 \(host [^)]*\), local rank (\d) -> global rank (\d) of 4, "
                       r".* agent pid (\d+)", output)
    assert sorted(r[2] for r in ranks) == ["0", "1", "2", "3"], output
    by_agent = {}
    for node, local, _, agent in ranks:
        by_agent.setdefault(agent, set()).add((node, local))
    # two torchrun agents, one per node, each with local ranks 0 and 1
    assert sorted(map(sorted, by_agent.values())) == [[("0", "0"), ("0", "1")],
                                                      [("1", "0"), ("1", "1")]], output
    assert "all-reduce of the ranks: 6 (expected 6) -> one group of 4" in output
    # SLURM started the job's step (one torchrun each) on both nodes
    for node in ("n1", "n2"):
        log = (cluster.folder / "log" / f"slurmd-{node}.log").read_text()
        assert f"StepId={job['JobId']}.0" in log, f"no step of the job on {node}"


def test_the_static_form_trains_as_torchrun_does_on_one_node(torchrun_jobs):
    output, job = torchrun_jobs["static"]
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]")
    assert re.search(r"job \d+: 2 nodes x 2 workers, head node n1:\d+", output), output
    training = training_lines(output)
    assert training[0].startswith("4 ranks, backend gloo"), output
    # the same figures, digit for digit, as 4 workers of one torchrun on one node
    assert training == training_lines(torchrun_jobs["one node"]), output
    assert training[-1] == "RESULT: DDP == single process on the global batch"
    assert "replicas identical across ranks: True (max spread 0.0e+00)" in training


# --- the autograder: submit_grading.sh ---------------------------------------------------------

ASSIGNMENT = "11_beyond_ddp"
SCORES = {"alice": 42.0, "bob": 12.0, "carol": 0.0}


def small_class(root: Path, students: list[str]) -> Path:
    """alice: every notebook solved; bob: pipeline_schedule solved (12 points) and
    tensor_parallel_linear as released; carol: build_2d_groups and sharded_optimizer as released
    (every function a stub). Each of bob and carol leaves out the other two notebooks (graded end
    to end, every release and every solution: tests/test_grading_every_assignment.py). Returns
    SUBMISSIONS."""
    notebooks = {exercise.slug: exercise for exercise in exercises()
                 if exercise.assignment == ASSIGNMENT}
    handed_in = {
        "alice": {slug: solved_release(exercise) for slug, exercise in notebooks.items()},
        "bob": {"pipeline_schedule": solved_release(notebooks["pipeline_schedule"]),
                "tensor_parallel_linear": nbformat.read(
                    notebooks["tensor_parallel_linear"].release, as_version=4)},
        "carol": {slug: nbformat.read(notebooks[slug].release, as_version=4)
                  for slug in ("build_2d_groups", "sharded_optimizer")}}
    for student in students:
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        for slug, notebook in handed_in[student].items():
            nbformat.write(notebook, folder / f"{slug}.ipynb")
    return root / "submitted"


def submit(cluster: Cluster, submissions: Path, out: Path, shards: int) -> tuple[str, str, str]:
    """submit_grading.sh, as the instructor runs it; (its output, array job id, merge job id)."""
    said = cluster.run(["bash", str(SUBMIT), str(submissions), ASSIGNMENT, str(out), str(shards)],
                       JOBS="1", STUDENT_TIMEOUT="600", DDPCOURSE_CHECK_TIMEOUT_S="60")
    array, merge = re.search(r"grading array (\d+) .*, merge (\d+) after it", said).groups()
    return said, array, merge


@pytest.fixture(scope="module")
def grading(cluster, tmp_path_factory):
    """The class graded through SLURM in 3 shards; and a second submission whose shard 1 of 2
    fails (a file left where its output folder goes). That merging shards gives what one run
    gives is tests/test_autograder_shards.py's (locally, cell by cell); here the merged output
    is held to what each student earns, so the class is graded once."""
    root = tmp_path_factory.mktemp("grading")
    submissions = small_class(root, ["alice", "bob", "carol"])
    slurm_out = root / "slurm"
    failing_in = small_class(root / "failing", ["carol"])
    failing_out = root / "failing" / "graded"
    failing_out.mkdir()
    (failing_out / "shard-1-of-2").write_text("left over from another run\n")

    said, array, merge = submit(cluster, submissions, slurm_out, 3)
    failed_said, failed_array, failed_merge = submit(cluster, failing_in, failing_out, 2)
    cluster.wait_until_gone([array, merge, failed_array, failed_merge], timeout=800)
    return {"slurm": (said, slurm_out, cluster.jobs(array), cluster.jobs(merge)[0]),
            "failing": (failed_said, failing_out, cluster.jobs(failed_array),
                        cluster.jobs(failed_merge)[0])}


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def test_each_array_task_grades_its_shard_then_the_merge_runs(grading):
    said, out, tasks, merge = grading["slurm"]
    assert f"3 submissions of {ASSIGNMENT} in 3 shards: up to 1 per shard, 1 at a time, at most 20 " \
           "minutes per task" in said
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1", "2"]
    for task in tasks:
        assert (task["JobState"], task["ExitCode"]) == ("COMPLETED", "0:0"), task
        # the limits submit_grading.sh sized for JOBS=1: 2 cores, 4 GiB, 1 wave of 600 s + 10 min
        assert (task["NumCPUs"], task["MinMemoryNode"], task["TimeLimit"]) == (
            "2", "4G", "00:20:00")
        shard = int(task["ArrayTaskId"]) + 1
        summary = json.loads((out / f"shard-{shard}-of-3" / "summary.json").read_text())
        assert [r["student"] for r in summary["results"]] == [["alice", "bob", "carol"][shard - 1]]
        assert (out / "logs" / f"grade-shard-{task['ArrayJobId']}_{task['ArrayTaskId']}.log"
                ).read_text().startswith(f"+ python -m autograder grade {out.parent}/submitted ")
    assert (merge["JobState"], merge["ExitCode"]) == ("COMPLETED", "0:0"), merge
    # the merge became eligible only once every task had ended (--dependency=afterok)
    assert merge["StartTime"] >= max(t["EndTime"] for t in tasks)
    assert not list(out.glob("*.failed.txt"))


def test_the_merged_output_gives_each_student_what_they_earned(grading):
    """Cell by cell: alice every point, bob the 12 of pipeline_schedule, carol none; each
    notebook bob or carol did not hand in scores 0 and is named in their notes."""
    _, out, _, _ = grading["slurm"]
    rows = {row["student_id"]: row for row in read_csv(out / "grades.csv")[1]}
    assert {student: (float(row["score"]), row["status"], row["flags"])
            for student, row in rows.items()} == {
        student: (score, "graded", "") for student, score in SCORES.items()}
    layout = gradesheet.layout(ASSIGNMENT)
    full = {notebook.slug: {notebook.cell_column(cell, points): f"{points:g}"
                            for cell, points in notebook.cells} for notebook in layout}
    none = {slug: dict.fromkeys(columns, "0") for slug, columns in full.items()}
    bob = {**none, "pipeline_schedule": full["pipeline_schedule"]}  # missing ones score 0
    for student, expected in {"alice": full, "bob": bob, "carol": none}.items():
        for slug, cells in expected.items():
            assert {column: rows[student][column] for column in cells} == cells, (student, slug)
    for student, missing in {"bob": ("build_2d_groups", "sharded_optimizer"),
                             "carol": ("pipeline_schedule", "tensor_parallel_linear")}.items():
        for slug in missing:
            assert f"missing: {slug}" in rows[student]["notes"], rows[student]["notes"]
    assert "missing" not in rows["alice"]["notes"]
    assert sorted(gradebook_submissions(out, ASSIGNMENT)) == ["alice", "bob", "carol"]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["student"] for r in summary["results"]] == ["alice", "bob", "carol"]
    assert not any(r.get("grader_errors") for r in summary["results"])
    assert [part["shard"] for part in summary["merged_from"]] == ["1/3", "2/3", "3/3"]
    for student in SCORES:  # a page for every notebook, a notice for one not handed in
        for notebook in layout:
            page = out / "feedback" / student / ASSIGNMENT / f"{notebook.slug}.html"
            assert page.is_file(), page


def test_a_failing_shard_keeps_the_merge_from_running_and_says_why(grading):
    said, out, tasks, merge = grading["failing"]
    states = {t["ArrayTaskId"]: (t["JobState"], t["ExitCode"]) for t in tasks}
    assert states["0"][0] == "FAILED" and states["1"] == ("COMPLETED", "0:0"), states
    assert merge["JobState"] == "CANCELLED" and merge["RunTime"] == "00:00:00", merge
    assert not (out / "grades.csv").exists() and not (out / "summary.json").exists()
    # the instructor is told where to look when submitting, and the failed task says why
    note_path = out / "shard-1-of-2.failed.txt"
    assert str(out / "shard-I-of-2.failed.txt") in said
    note = note_path.read_text()
    log = out / "logs" / f"grade-shard-{tasks[0]['ArrayJobId']}_0.log"
    assert f"shard 1/2 of {ASSIGNMENT} failed (exit code 1)" in note
    assert f"Why: the end of its log, {log} " in note
    assert "FileExistsError" in log.read_text() and note in log.read_text()
    assert "The merge job waiting for this array will not run" in note
    # and how to finish by hand: two commands the autograder takes as they are written
    commands = [shlex.split(line) for line in note.splitlines() if line.startswith("    ")]
    assert [c[1:3] for c in commands] == [["-m", "autograder"]] * 2
    grade, merge_args = (build_parser().parse_args(c[3:]) for c in commands)
    assert (grade.command, grade.out, grade.shard) == ("grade", out / "shard-1-of-2", Shard(1, 2))
    assert merge_args.command == "merge" and merge_args.out == out
    assert merge_args.outputs == [out / "shard-1-of-2", out / "shard-2-of-2"]


# --- the cluster scripts themselves -------------------------------------------------------------

def test_stopping_a_cluster_ends_its_running_jobs_and_daemons(tmp_path):
    """A job still running on both nodes when the cluster is stopped: nothing of it is left."""
    reason = why_no_cluster()
    if reason:
        pytest.skip(reason)
    folder = tmp_path / "cluster"
    try:
        start(folder, NODES="2", CPUS_PER_NODE="1")
        # the node names resolve, by one line of /etc/hosts however often a cluster starts
        assert Path("/etc/hosts").read_text().count("ddp-course local SLURM cluster") <= 1
        assert all(socket.gethostbyname(name).startswith("127.") for name in ("n1", "n2"))
        cluster = Cluster(folder)
        job = cluster.run(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/job.out",
                           "--wrap", "srun sleep 300"]).strip()
        give_up = time.monotonic() + 60
        while sum("sleep" in p for p in processes_of(folder)) < 2:  # one per node
            assert time.monotonic() < give_up, cluster.jobs(job)
            time.sleep(0.2)
        daemons = sorted(p.split()[1] for p in processes_of(folder)
                         if p.split()[1] in ("munged", "slurmctld", "slurmd"))
        assert daemons == ["munged", "slurmctld", "slurmd", "slurmd"]
    finally:
        left = stop(folder)
    assert not left, f"still running after the stop: {left}"
