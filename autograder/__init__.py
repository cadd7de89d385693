"""The course's grading set-up: nbgrader config, the exercises found in solutions/, grading.

    python -m autograder release                                  # exercises/ from solutions/
    python -m autograder grade SUBMISSIONS --assignment NN_topic  # see autograder/README.md
"""

import sys

# jsonschema (which nbformat imports) imports rfc3987_syntax, where it is installed, only to check
# the "iri" string formats, which nothing the autograder validates uses (nbformat's schema has
# none); building that package's grammar at import costs ~1 s of CPU in every process that imports
# nbformat: each grading command, worker and merge. jsonschema skips a module that is absent.
sys.modules.setdefault("rfc3987_syntax", None)
