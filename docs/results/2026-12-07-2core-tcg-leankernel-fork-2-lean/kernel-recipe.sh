# The "lean" guest kernel of these runs (not adopted; see benchmarks.md), as built:
apt-get download linux-source-6.12=6.12.118-1~deb12u1 linux-image-6.12.118+deb12-cloud-amd64
dpkg-deb --fsys-tarfile linux-source-6.12_*.deb | tar -x && tar -xJf usr/src/linux-source-6.12.tar.xz
cd linux-source-6.12
dpkg-deb --fsys-tarfile ../linux-image-6.12.118+deb12-cloud-amd64_*.deb | tar -xO ./boot/config-6.12.118+deb12-cloud-amd64 > .config
S=scripts/config
for m in VSOCKETS VIRTIO_VSOCKETS VIRTIO_VSOCKETS_COMMON VSOCKETS_LOOPBACK VIRTIO_BLK HW_RANDOM_VIRTIO VIRTIO_NET FAILOVER NET_FAILOVER OVERLAY_FS SQUASHFS VIRTIO_MMIO TUN VETH; do $S -e $m; done
sed -i -E 's/^(CONFIG_[A-Za-z0-9_]+)=m$/# \1 is not set/' .config   # no modules but those built in above
$S -d SECURITY -d AUDIT -d HARDENED_USERCOPY -d FORTIFY_SOURCE -d STACKPROTECTOR -d STACKPROTECTOR_STRONG \
   -d INIT_ON_ALLOC_DEFAULT_ON -d SLAB_FREELIST_HARDENED -d SLAB_FREELIST_RANDOM -d DEBUG_LIST -d LIST_HARDENED \
   -d RANDOMIZE_KSTACK_OFFSET -d RANDOMIZE_KSTACK_OFFSET_DEFAULT -d BUG_ON_DATA_CORRUPTION -d SLAB_BUCKETS \
   -d RANDOM_KMALLOC_CACHES -d SHUFFLE_PAGE_ALLOCATOR -d PSI -d SCHEDSTATS -d TASK_DELAY_ACCT -d TASKSTATS \
   -d SCHED_AUTOGROUP -d PROC_EVENTS -d NO_HZ_FULL -e NO_HZ_IDLE -d NUMA -d NUMA_BALANCING -d TRANSPARENT_HUGEPAGE \
   -d KSM -d KFENCE -d LRU_GEN -d VMAP_STACK -d SLUB_DEBUG -d CPU_MITIGATIONS -d INIT_STACK_ALL_ZERO -e INIT_STACK_NONE \
   -d MODULE_SIG -d DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT -e DEBUG_INFO_NONE -d DEBUG_INFO -d DEBUG_INFO_BTF \
   -d CGROUP_BPF -d CFS_BANDWIDTH -d SCHED_MM_CID -d IKHEADERS --set-str LOCALVERSION -forkvm-lean -d LOCALVERSION_AUTO \
   --set-str SYSTEM_TRUSTED_KEYS "" --set-str SYSTEM_REVOCATION_KEYS ""
make olddefconfig && make -j2 bzImage modules     # 11 min on the 2-core machine (18 min user CPU)
# Installed as $FORKVM_CACHE/kernel/6.12.118-forkvm-lean/{vmlinuz,modules/modules.builtin,modules/kernel/,.complete}
# and chosen with FORKVM_KERNEL_PACKAGE=linux-image-6.12.118-forkvm-lean and that FORKVM_CACHE.
