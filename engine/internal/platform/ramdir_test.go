package platform

import (
	"strings"
	"testing"
)

func TestHugeShmemMount(t *testing.T) {
	const info = `22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,inode64
30 25 0:40 / /dev/shm/forkvm-huge rw,relatime - tmpfs tmpfs rw,size=20971520k,mode=700,huge=within_size
31 25 0:41 / /dev/shm/forkvm-never rw,relatime - tmpfs tmpfs rw,mode=700,huge=never
32 22 0:42 / /mnt/with\040space rw - tmpfs tmpfs rw,huge=always
33 22 0:43 / /mnt/ext rw - ext4 /dev/sdb rw,huge=always
`
	for _, c := range []struct {
		dir  string
		huge bool
		opt  string
	}{
		{"/dev/shm/forkvm-abc", false, ""},
		{"/dev/shm", false, ""},
		{"/dev/shm/forkvm-huge", true, "huge=within_size"},
		{"/dev/shm/forkvm-huge/sub/", true, "huge=within_size"},
		{"/dev/shm/forkvm-hugeX", false, ""}, // a sibling, not below the mount
		{"/dev/shm/forkvm-never/x", false, ""},
		{"/mnt/with space/ram", true, "huge=always"},
		{"/mnt/ext/ram", false, ""}, // not a tmpfs
		{"/tmp/x", false, ""},
	} {
		huge, opt := hugeShmemMount(strings.NewReader(info), c.dir)
		if huge != c.huge || opt != c.opt {
			t.Errorf("%s: %v %q, want %v %q", c.dir, huge, opt, c.huge, c.opt)
		}
	}
	if huge, _ := hugeShmemMount(strings.NewReader("garbage\n\n1 2 3\n"), "/x"); huge {
		t.Error("garbage mountinfo: huge")
	}
	if !forcedHugeShmem("always within_size advise never deny [force]\n") || forcedHugeShmem("always within_size advise [never] deny force\n") {
		t.Error("forcedHugeShmem")
	}
}
