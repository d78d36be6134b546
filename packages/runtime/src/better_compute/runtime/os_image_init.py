"""The scripts inside the test OS image: its ``/init`` and its small cloud-init.

The test OS is the smallest thing that boots from a disk like an installed OS and takes its user
data the way a cloud image does: syslinux loads a kernel and an initramfs (the ramdisk's parts,
``runtime.ramdisk``) whose ``/init`` mounts the image's state partition, finds the NoCloud config
drive bcd wrote after the image (the partition labelled ``cidata``), and on the first boot of an
instance runs the small part of cloud-init the project's cloud-init template needs:
``hostname``, ``write_files``, then ``runcmd`` with busybox ``sh`` (``curl -fsSL -o`` is busybox
``wget``; ``sha256sum -c`` is busybox's), so the template's own lines download bcd and join.
Then it runs ``bcd run --mode installed`` and starts it again whenever it exits.

``CLOUD_INIT`` reads only JSON cloud-config (what the project's templates write; JSON is YAML):
anything else, or a module it does not implement, is refused loudly rather than half-applied.
Kept apart from the builder (``os_image``) so the text is plain to read and the unit tests run
the very same scripts with the host's busybox.
"""

from __future__ import annotations

from typing import Final

from .ramdisk_init import COLDPLUG, MOUNTS

__all__ = ["CLOUD_INIT", "CURL", "JSON_AWK", "OS_INIT", "STATE_LABEL", "SYSLINUX_CFG"]

STATE_LABEL: Final = "bc-state"
"""The ext4 partition that keeps ``/var/lib/bcd``, ``/etc/bcd`` and ``/usr/local`` across boots."""

JSON_AWK: Final = r"""# Every scalar of a JSON document (after an optional "#cloud-config" line) as
# PATH<TAB>VALUE, one per line: PATH is the keys and array indexes joined by ".", VALUE is
# escaped for printf %b (backslash, newline, tab, other bytes as \0NNN), so it holds no line
# break. Exit 1 on bad JSON.
BEGIN { RS = "\001" }
{ doc = doc $0 }
END {
    sub(/^#cloud-config[^\n]*\n/, "", doc)
    pos = 1; n = length(doc)
    for (i = 0; i < 256; i++) ORD[sprintf("%c", i)] = i
    value("")
    ws()
    if (pos <= n) fail("trailing data")
}
function fail(msg) { printf "bc-cloud-init: not JSON: %s at %d\n", msg, pos > "/dev/stderr"; exit 1 }
function ws(c) {
    while (pos <= n) {
        c = substr(doc, pos, 1)
        if (c == " " || c == "\t" || c == "\n" || c == "\r") pos++; else break
    }
}
function value(path, c) {
    ws(); c = substr(doc, pos, 1)
    if (c == "{") obj(path)
    else if (c == "[") arr(path)
    else if (c == "\"") emit(path, str())
    else lit(path)
}
function join(path, key) { return path == "" ? key : path "." key }
function obj(path, key, c) {
    pos++; ws()
    if (substr(doc, pos, 1) == "}") { pos++; return }
    while (1) {
        ws()
        if (substr(doc, pos, 1) != "\"") fail("expected a key")
        key = str(); ws()
        if (substr(doc, pos, 1) != ":") fail("expected :")
        pos++
        value(join(path, key))
        ws(); c = substr(doc, pos, 1); pos++
        if (c == "}") return
        if (c != ",") fail("expected , or }")
    }
}
function arr(path, i, c) {
    pos++; ws(); i = 0
    if (substr(doc, pos, 1) == "]") { pos++; return }
    while (1) {
        value(join(path, i)); i++
        ws(); c = substr(doc, pos, 1); pos++
        if (c == "]") return
        if (c != ",") fail("expected , or ]")
    }
}
function lit(path, tok) {
    tok = ""
    while (pos <= n && substr(doc, pos, 1) ~ /[-+.0-9a-zE]/) { tok = tok substr(doc, pos, 1); pos++ }
    if (tok == "") fail("expected a value")
    if (tok !~ /^(true|false|null|-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)$/) fail("bad literal " tok)
    emit(path, tok)
}
function hex(s, v, i, c) {
    v = 0
    for (i = 1; i <= length(s); i++) {
        c = index("0123456789abcdef", tolower(substr(s, i, 1)))
        if (c == 0) fail("bad \\u escape")
        v = v * 16 + c - 1
    }
    return v
}
function byte(v) { return sprintf("\\0%03o", v) }
function utf8(v) {
    if (v < 128) return v == 92 ? "\\\\" : (v < 32 ? byte(v) : sprintf("%c", v))
    if (v < 2048) return byte(192 + int(v / 64)) byte(128 + v % 64)
    if (v >= 55296 && v < 57344) fail("surrogate \\u escapes are not supported")
    return byte(224 + int(v / 4096)) byte(128 + int(v / 64) % 64) byte(128 + v % 64)
}
function str(out, c, e) {
    pos++; out = ""
    while (pos <= n) {
        c = substr(doc, pos, 1); pos++
        if (c == "\"") return out
        if (c == "\\") {
            e = substr(doc, pos, 1); pos++
            if (e == "n") out = out "\\n"
            else if (e == "t") out = out "\\t"
            else if (e == "r") out = out "\\r"
            else if (e == "b") out = out "\\b"
            else if (e == "f") out = out "\\f"
            else if (e == "\\") out = out "\\\\"
            else if (e == "\"" || e == "/") out = out e
            else if (e == "u") { out = out utf8(hex(substr(doc, pos, 4))); pos += 4 }
            else fail("bad escape")
        } else if (ORD[c] < 32) fail("a control character in a string")
        else if (ORD[c] >= 128) out = out byte(ORD[c])
        else out = out c
    }
    fail("unterminated string")
}
function emit(path, v) { printf "%s\t%s\n", path, v }
"""

CLOUD_INIT: Final = r"""#!/bin/sh
# bc-cloud-init USER-DATA: the part of cloud-init the project's cloud-init template needs, run
# once per instance by /init: hostname, write_files (path, content, permissions), then runcmd
# (each a string, run by sh; the first that fails stops it, and the instance is tried again on
# the next boot). $BC_CLOUD_ROOT prefixes the paths write_files writes (tests).
set -u
ud=$1
say() { echo "bc-cloud-init: $*" >&2; }
if ! head -n 1 "$ud" | grep -q '^#cloud-config'; then
    say "user-data is not #cloud-config: not supported"; exit 1
fi
flat=$(awk -f "${BC_CLOUD_AWK:-/etc/bc-os/json.awk}" "$ud") || {
    say "only JSON cloud-config is supported"; exit 1
}
get() {
    printf '%s\n' "$flat" | awk -F '\t' -v k="$1" \
        '$1 == k { sub(/^[^\t]*\t/, ""); print; found = 1; exit } END { exit !found }'
}
for key in $(printf '%s\n' "$flat" | cut -f 1 | cut -d . -f 1 | sort -u); do
    case "$key" in
        hostname|write_files|runcmd) ;;
        *) say "module $key is not supported: refusing the user data"; exit 1 ;;
    esac
done
if name=$(get hostname); then
    name=$(printf '%b' "$name")
    mkdir -p "${BC_CLOUD_ROOT:-}/etc"
    echo "$name" > "${BC_CLOUD_ROOT:-}/etc/hostname"
    # the running system's name only on the machine itself (a test's root is not one)
    [ -z "${BC_CLOUD_ROOT:-}" ] && hostname "$name"
fi
i=0
while path=$(get "write_files.$i.path"); do
    for field in $(printf '%s\n' "$flat" | cut -f 1 | grep "^write_files\.$i\." | cut -d . -f 3 | sort -u); do
        case "$field" in
            path|content|permissions) ;;
            *) say "write_files $field is not supported"; exit 1 ;;
        esac
    done
    path=$(printf '%b' "$path")
    target="${BC_CLOUD_ROOT:-}$path"
    mkdir -p "$(dirname "$target")"
    umask 077
    content=$(get "write_files.$i.content") || content=""
    printf '%b' "$content" > "$target" || exit 1
    umask 022
    mode=$(get "write_files.$i.permissions") || mode=0644
    chmod "$mode" "$target" || exit 1
    say "wrote $path ($mode)"
    i=$((i + 1))
done
i=0
while cmd=$(get "runcmd.$i"); do
    cmd=$(printf '%b' "$cmd")
    say "runcmd $i"
    sh -c "$cmd" || { say "runcmd $i failed ($?)"; exit 1; }
    i=$((i + 1))
done
if printf '%s\n' "$flat" | cut -f 1 | grep -q '^runcmd\.[0-9]*\.'; then
    say "runcmd entries that are lists are not supported"; exit 1
fi
exit 0
"""

CURL: Final = r"""#!/bin/sh
# curl, as far as the cloud-init template uses it: curl -fsSL -o FILE URL, with busybox wget
# (which follows redirects and fails on an HTTP error, as -f and -L ask).
out=""
url=""
while [ $# -gt 0 ]; do
    case "$1" in
        -o) out=$2; shift 2 ;;
        -[fsSL]*) shift ;;
        -*) echo "curl: option $1 is not supported here" >&2; exit 2 ;;
        *) url=$1; shift ;;
    esac
done
[ -n "$url" ] || { echo "curl: no URL" >&2; exit 2; }
if [ -n "$out" ]; then exec wget -q -O "$out" "$url"; fi
exec wget -q -O - "$url"
"""

OS_INIT: Final = (
    r"""#!/bin/sh
# bc-os /init (PID 1) of the test OS image: mount, load drivers, DHCP, the state partition, the
# NoCloud config drive (cloud-init once per instance), then bcd run --mode installed, restarted
# whenever it exits. Everything goes to the console.
export PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p /proc /sys /dev /run /tmp /var/lib/bcd /etc/bcd /usr/local
"""
    + MOUNTS
    + r"""echo "bc-os: $(cat /etc/bc-ramdisk/release) on $(uname -r)"
# drivers by modalias as the ramdisk loads them (runtime.ramdisk_init): twice, for the devices
# the first drivers bring (the virtio disk and NIC behind virtio_pci)
"""
    + COLDPLUG
    + r"""echo "bc-os: $(wc -l < /proc/modules) modules loaded"
hostname bc-os
# the disk's partitions appear once its driver probed it
find_label() {
    tries=0
    while [ "$tries" -lt 50 ]; do
        dev=$(findfs "LABEL=$1" 2>/dev/null) && { echo "$dev"; return 0; }
        tries=$((tries + 1)); sleep 0.2
    done
    return 1
}
if state=$(find_label @STATE_LABEL@); then
    mkdir -p /persist
    mount -t ext4 "$state" /persist
    for d in var/lib/bcd etc/bcd usr/local cloud; do mkdir -p "/persist/$d"; done
    mount --bind /persist/var/lib/bcd /var/lib/bcd
    mount --bind /persist/etc/bcd /etc/bcd
    mount --bind /persist/usr/local /usr/local
    echo "bc-os: state on $state"
else
    echo "bc-os: no @STATE_LABEL@ partition: nothing persists"
    mkdir -p /persist/cloud
fi
sh /etc/bc-ramdisk/net-up
if drive=$(find_label cidata); then
    mkdir -p /run/cidata
    mount -t iso9660 -o ro "$drive" /run/cidata
    instance=$(sed -n 's/^instance-id: *//p' /run/cidata/meta-data)
    name=$(sed -n 's/^local-hostname: *//p' /run/cidata/meta-data)
    [ -n "$name" ] && hostname "$name"
    echo "bc-os: config drive $drive, instance $instance"
    if [ "$(cat /persist/cloud/instance-id 2>/dev/null)" != "$instance" ]; then
        if bc-cloud-init /run/cidata/user-data; then
            echo "$instance" > /persist/cloud/instance-id
            echo "bc-os: cloud-init done"
        else
            echo "bc-os: cloud-init failed; it runs again on the next boot"
        fi
    fi
    umount /run/cidata
else
    echo "bc-os: no config drive"
fi
sync
delay=1
while true; do
    if [ -f /var/lib/bcd/enrollment.json ]; then
        delay=1
        echo "bc-os: bcd run --mode installed"
        bcd run --mode installed
        echo "bc-os: bcd exited ($?); restarting"
    else
        echo "bc-os: bcd has not joined; looking again in ${delay}s"
        [ "$delay" -lt 30 ] && delay=$((delay * 2))
    fi
    sleep "$delay"
done
"""
).replace("@STATE_LABEL@", STATE_LABEL)

SYSLINUX_CFG: Final = """SERIAL 0 115200
DEFAULT bc-os
PROMPT 0
TIMEOUT 0
LABEL bc-os
  LINUX /vmlinuz
  INITRD /initrd.img
  APPEND {cmdline}
"""
"""syslinux's configuration on the boot partition; ``{cmdline}`` is the kernel's."""
