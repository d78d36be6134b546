# Sourced by scripts/test.sh: the Debian packages the tests need that no wheel brings.
# QEMU with its iPXE network ROMs runs the site agent's network-boot test (a real iPXE client,
# user-mode networking, no root network set-up) and the VM lab's machines (docs/vm-lab.md; QEMU
# started under util-linux's setpriv --pdeathsig); e2fsprogs and util-linux make and find the
# file-system signatures bcd's wipe test erases; cloud-init and ignition bring the formats' own
# validators (`cloud-init schema`, `ignition-validate`) the user-data tests run; openssl signs
# images as docs/images.md shows, in the catalog's bcx test; GNU cpio reads back the initramfs
# archives the ramdisk builder writes (the builder itself needs apt-get and dpkg-deb, which Debian has,
# and binutils' strip for the libraries PyInstaller packs). Installed as root with apt-get when missing;
# without root, say what is missing and carry on (those tests then fail, they are never skipped).
_bc_missing=()
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then _bc_missing+=(qemu-system-x86); fi
if [ ! -e /usr/lib/ipxe/qemu/pxe-e1000.rom ]; then _bc_missing+=(ipxe-qemu); fi
if ! command -v mkfs.ext4 >/dev/null 2>&1; then _bc_missing+=(e2fsprogs); fi
if ! command -v wipefs >/dev/null 2>&1; then _bc_missing+=(util-linux); fi
if ! command -v cloud-init >/dev/null 2>&1; then _bc_missing+=(cloud-init); fi
if ! command -v ignition-validate >/dev/null 2>&1; then _bc_missing+=(ignition); fi
if ! command -v openssl >/dev/null 2>&1; then _bc_missing+=(openssl); fi
# isoinfo reads bcd's config drive back in its unit test; syslinux (mbr.bin, ldlinux), mtools and
# dosfstools make the test OS image's boot partition without loop mounts; busybox-static is its
# userland (and runs its cloud-init subset in a unit test)
if ! command -v isoinfo >/dev/null 2>&1; then _bc_missing+=(genisoimage); fi
if ! command -v syslinux >/dev/null 2>&1; then _bc_missing+=(syslinux); fi
if [ ! -e /usr/lib/syslinux/mbr/mbr.bin ]; then _bc_missing+=(syslinux-common); fi
if ! command -v mcopy >/dev/null 2>&1; then _bc_missing+=(mtools); fi
if ! command -v mkfs.vfat >/dev/null 2>&1; then _bc_missing+=(dosfstools); fi
if [ ! -x /bin/busybox ]; then _bc_missing+=(busybox-static); fi
if ! command -v cpio >/dev/null 2>&1; then _bc_missing+=(cpio); fi
if ! command -v strip >/dev/null 2>&1; then _bc_missing+=(binutils); fi
if [ "${#_bc_missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${_bc_missing[*]} with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${_bc_missing[@]}" >&2
  else
    echo "bootstrap: missing ${_bc_missing[*]} (install them as root; tests need them)" >&2
  fi
fi
unset _bc_missing
