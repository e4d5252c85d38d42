#!/usr/bin/env bash
# Helpers the build scripts source: required variables and sources fetched at an exact commit.
set -euo pipefail

# require NAME...: fail naming every variable that is unset or empty (they come from images/versions.env).
require() {
    local missing=() name
    for name in "$@"; do
        [[ -n "${!name:-}" ]] || missing+=("$name")
    done
    if ((${#missing[@]})); then
        echo "error: ${missing[*]} not set; export them from images/versions.env (images/build.py passes them to Docker)" >&2
        exit 2
    fi
}

# clone_at URL TAG COMMIT DEST: a shallow clone of TAG that must resolve to COMMIT, so a moved tag fails the
# build instead of building something else.
clone_at() {
    local url=$1 tag=$2 commit=$3 dest=$4 head
    git clone --quiet --depth 1 --branch "$tag" "$url" "$dest"
    head=$(git -C "$dest" rev-parse HEAD)
    if [[ "$head" != "$commit" ]]; then
        echo "error: $url tag $tag is at $head, expected $commit (versions.env); refusing to build" >&2
        exit 1
    fi
}
