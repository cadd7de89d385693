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
# OUT. If a task fails, the merge never starts (--kill-on-invalid-dep removes it); grade that
# shard again with the command at the top of its log (grade-shard-JOB_TASK.log), then run the
# merge by hand.
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

# shellcheck disable=SC2086  # GRADING_SBATCH_OPTIONS is a list of options
array=$(sbatch --parsable --array="0-$(( shards - 1 ))" \
    --cpus-per-task=$(( 2 * jobs )) --mem="$(( 4 * jobs ))G" --time="$minutes" \
    --export=ALL,GRADING_JOBS="$jobs",STUDENT_TIMEOUT="$student_timeout" \
    ${GRADING_SBATCH_OPTIONS:-} "$here/grade_array.sbatch" "$submissions" "$assignment" "$out")
array=${array%%;*}  # --parsable prints "jobid" or "jobid;cluster"

outputs=""
for (( i = 1; i <= shards; i++ )); do
    outputs+=" $(printf %q "$out/shard-$i-of-$shards")"
done
# shellcheck disable=SC2086
merge=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes \
    --job-name=grade-merge --cpus-per-task=1 --mem=2G --time=30 --output="grade-merge-%j.log" \
    ${GRADING_SBATCH_OPTIONS:-} \
    --wrap "${PYTHON:-python} -m autograder merge$outputs --out $(printf %q "$out")")
echo "submitted: grading array $array ($shards tasks), merge ${merge%%;*} after it"
