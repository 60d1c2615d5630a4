#!/usr/bin/env bash
# The current figure sheet at the top of BENCHMARKS.md, made from the JSON
# files of docs/figures/ (one per bench part, each carrying its run: machine,
# date, commit) by `memveil bench --sheet`, so the table cannot drift from
# what was measured.
#
#   scripts/figures.sh                 rewrite BENCHMARKS.md's table from docs/figures/*.json
#   scripts/figures.sh --check         fail if BENCHMARKS.md's table is not what the files give
#   scripts/figures.sh --run PART...   measure PART(s) again (memveil bench --only PART --json
#                                      docs/figures/PART.json; the file it replaces is kept
#                                      as docs/figures/previous/PART.json, so the table says
#                                      which figures moved by more than their spread), then
#                                      rewrite the table
#
# Needs target/release/memveil (cargo build --release), or MEMVEIL=path.
set -euo pipefail
cd "$(dirname "$0")/.."

MEMVEIL=${MEMVEIL:-target/release/memveil}
FIGURES=docs/figures
DOC=BENCHMARKS.md
BEGIN='<!-- figures:begin (scripts/figures.sh writes this table; do not edit by hand) -->'
END='<!-- figures:end -->'

die() { echo "figures.sh: $*" >&2; exit 1; }

[ -x "$MEMVEIL" ] || die "$MEMVEIL not found: build it first (cargo build --release) or set MEMVEIL"

mode=write
case "${1:-}" in
    --check) mode=check ;;
    --run)
        shift
        [ $# -gt 0 ] || die "--run needs the parts to measure (see memveil bench --help)"
        mkdir -p "$FIGURES"
        for part in "$@"; do
            echo "figures.sh: measuring $part (memveil bench --only $part)" >&2
            tmp=$(mktemp -d)
            # A part that fails leaves its previous file in place.
            "$MEMVEIL" bench --only "$part" --json "$tmp/$part.json" --out "$tmp/report" >&2 \
                || die "memveil bench --only $part failed; $FIGURES/$part.json kept"
            if [ -f "$FIGURES/$part.json" ]; then
                mkdir -p "$FIGURES/previous"
                cp "$FIGURES/$part.json" "$FIGURES/previous/$part.json"
            fi
            mv "$tmp/$part.json" "$FIGURES/$part.json"
            rm -rf "$tmp"
        done
        ;;
    "") ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
esac

shopt -s nullglob
files=("$FIGURES"/*.json)
[ ${#files[@]} -gt 0 ] || die "no $FIGURES/*.json: measure with scripts/figures.sh --run PART"
grep -qxF "$BEGIN" "$DOC" && grep -qxF "$END" "$DOC" \
    || die "$DOC lacks the markers around its table ($BEGIN ... $END)"

sheet=$(mktemp)
new=$(mktemp)
trap 'rm -f "$sheet" "$new"' EXIT
previous=("$FIGURES"/previous/*.json)
if [ ${#previous[@]} -gt 0 ]; then
    "$MEMVEIL" bench --sheet "${files[@]}" --previous "${previous[@]}" > "$sheet"
else
    "$MEMVEIL" bench --sheet "${files[@]}" > "$sheet"
fi
awk -v begin="$BEGIN" -v end="$END" -v sheet="$sheet" '
    $0 == begin { print; while ((getline l < sheet) > 0) print l; skip = 1; next }
    $0 == end { skip = 0 }
    !skip { print }
' "$DOC" > "$new"

if [ "$mode" = check ]; then
    if ! cmp -s "$DOC" "$new"; then
        diff -u "$DOC" "$new" | head -40 >&2
        die "$DOC's figure table differs from what $FIGURES/*.json give: run scripts/figures.sh"
    fi
    echo "figures.sh: $DOC's table matches $FIGURES/*.json (${#files[@]} runs)"
else
    cat "$new" > "$DOC"
    echo "figures.sh: $DOC's table rewritten from ${#files[@]} runs" >&2
fi
