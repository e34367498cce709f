package engine

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestGuestEnd: a QEMU that exited 0 on its own says why from the console: a kernel
// panic's line (the last one, control characters dropped), else a power-off or reboot.
func TestGuestEnd(t *testing.T) {
	for _, tc := range []struct {
		name, console, want string
	}{
		{"init killed", "boot\r\n[    3.1] Kernel panic - not syncing: Attempted to kill init! exitcode=0x0000000b\r\n[    3.2] ---[ end Kernel panic",
			"guest kernel panic: Attempted to kill init! exitcode=0x0000000b"},
		{"the last panic", "Kernel panic - not syncing: first\nKernel panic - not syncing: sysrq triggered crash\x1b[0m\n",
			"guest kernel panic: sysrq triggered crash[0m"},
		{"behind a long console", strings.Repeat("x", 64<<10) + "\nKernel panic - not syncing: late\n", "guest kernel panic: late"},
		{"poweroff", "reboot: Power down\n", "qemu exit 0: the guest powered off or rebooted"},
		{"no console", "", "qemu exit 0: the guest powered off or rebooted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "serial.log")
			if tc.console != "" {
				if err := os.WriteFile(p, []byte(tc.console), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if got := guestEnd(p); got != tc.want {
				t.Errorf("guestEnd = %q, want %q", got, tc.want)
			}
		})
	}
}
