#!/bin/bash
# Grade a class on a SLURM cluster: one array task per shard, then a merge job that runs once
# every task has succeeded.
#
#     autograder/slurm/submit_grading.sh SUBMISSIONS ASSIGNMENT OUT SHARDS
#
# Run it from the repository root with the course's environment activated. It submits
# grade_array.sbatch as an array of SHARDS tasks, each grading --jobs JOBS submissions at once
# on 2*JOBS cores and 4*JOBS GiB (JOBS=4 by default), with a time limit that even a class whose
# every submission runs to --student-timeout (STUDENT_TIMEOUT, 1800 s by default) fits in; then
# a one-core job, --dependency=afterok on the array, that runs `python -m autograder merge` into
# OUT. Every job's log goes to OUT/logs/ (grade-shard-ARRAY_TASK.log, grade-merge-JOB.log). If a
# task fails, the merge never starts (--kill-on-invalid-dep cancels it): the task writes
# OUT/shard-I-of-N.failed.txt, with the end of its log to read and the two commands that finish
# the grading by hand (grade that shard again, then merge).
# Extra sbatch options (partition, account, --mem) go in GRADING_SBATCH_OPTIONS (not a name that
# sbatch itself reads), which come after the script's own and so win, e.g.
#     GRADING_SBATCH_OPTIONS="--partition=short --mem=24G" autograder/slurm/submit_grading.sh ...

set -euo pipefail

if (( $# != 4 )) || (( $4 < 1 )); then
    echo "usage: $0 SUBMISSIONS ASSIGNMENT OUT SHARDS (SHARDS >= 1)" >&2
    exit 2
fi
submissions=$1 assignment=$2 out=$3 shards=$4
jobs=${JOBS:-4}
student_timeout=${STUDENT_TIMEOUT:-1800}
here=$(cd "$(dirname "$0")" && pwd)

# the time limit: the largest shard, graded JOBS at a time, each submission at its deadline
folder=$submissions
[[ -d $folder/submitted ]] && folder=$folder/submitted
students=$(find "$folder" -mindepth 2 -maxdepth 2 -type d -name "$assignment" | wc -l)
per_shard=$(( (students + shards - 1) / shards ))
waves=$(( (per_shard + jobs - 1) / jobs ))
minutes=$(( (waves * student_timeout + 59) / 60 + 10 ))
echo "$students submissions of $assignment in $shards shards: up to $per_shard per shard," \
     "$jobs at a time, at most $minutes minutes per task"

logs=$out/logs
mkdir -p "$logs"  # SLURM does not create the folder of a job's --output
rm -f "$out"/shard-*-of-*.failed.txt  # an earlier submission's

# shellcheck disable=SC2086  # GRADING_SBATCH_OPTIONS is a list of options
array=$(sbatch --parsable --array="0-$(( shards - 1 ))" \
    --cpus-per-task=$(( 2 * jobs )) --mem="$(( 4 * jobs ))G" --time="$minutes" \
    --output="$logs/grade-shard-%A_%a.log" \
    --export=ALL,GRADING_JOBS="$jobs",STUDENT_TIMEOUT="$student_timeout" \
    ${GRADING_SBATCH_OPTIONS:-} "$here/grade_array.sbatch" "$submissions" "$assignment" "$out")
array=${array%%;*}  # --parsable prints "jobid" or "jobid;cluster"

outputs=""
for (( i = 1; i <= shards; i++ )); do
    outputs+=" $(printf %q "$out/shard-$i-of-$shards")"
done
# shellcheck disable=SC2086
merge=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes \
    --job-name=grade-merge --cpus-per-task=1 --mem=2G --time=30 --output="$logs/grade-merge-%j.log" \
    ${GRADING_SBATCH_OPTIONS:-} \
    --wrap "${PYTHON:-python} -m autograder merge$outputs --out $(printf %q "$out")")
merge=${merge%%;*}
echo "submitted: grading array $array ($shards tasks), merge $merge after it"
echo "logs: $logs/grade-shard-${array}_K.log (task K), $logs/grade-merge-$merge.log"
echo "when the merge has run: $out/grades.csv. If a task fails, the merge is cancelled and the" \
     "task writes why, and how to finish by hand, to $out/shard-I-of-$shards.failed.txt." \
     "Still queued or running: squeue -j $array,$merge"
