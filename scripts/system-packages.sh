# Sourced by bootstrap.sh: the Debian packages the tests need that no wheel brings.
# QEMU with its iPXE network ROMs runs the site agent's network-boot test (a real iPXE client,
# user-mode networking, no root network set-up). Installed as root with apt-get when missing;
# without root, say what is missing and carry on (that test then fails, it is never skipped).
_bc_need_qemu() {
  ! command -v qemu-system-x86_64 >/dev/null 2>&1 || [ ! -e /usr/lib/ipxe/qemu/pxe-e1000.rom ]
}
if _bc_need_qemu; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing qemu-system-x86 and ipxe-qemu with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      qemu-system-x86 ipxe-qemu >&2
  else
    echo "bootstrap: qemu-system-x86 and ipxe-qemu are missing (install them as root;" \
      "the network-boot test needs them)" >&2
  fi
fi
unset -f _bc_need_qemu
