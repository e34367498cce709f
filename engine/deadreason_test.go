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

// TestConsoleTail: an agent timeout quotes the end of the guest's console on one line:
// the last bytes (of the rotated log too), lines joined, control characters dropped;
// nothing without a log; and QEMUError says it after QEMU's own words.
func TestConsoleTail(t *testing.T) {
	dir := t.TempDir()
	log := filepath.Join(dir, "serial.log")
	if got := consoleTail(log, 600); got != "" {
		t.Errorf("no log: %q", got)
	}
	if err := os.WriteFile(log+".1", []byte("old line\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(log, []byte("[    1.2] ACPI: \x1b[0mready\r\n\r\nforkvm-agent: listening\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, want := consoleTail(log, 600), "old line | [    1.2] ACPI: [0mready | forkvm-agent: listening"; got != want {
		t.Errorf("consoleTail = %q, want %q", got, want)
	}
	if got, want := consoleTail(log, 10), "listening"; got != want {
		t.Errorf("consoleTail of 10 bytes = %q, want %q", got, want)
	}
	qe := &QEMUError{VM: "w", Op: "start", ExitCode: -1, Err: ErrAgentTimeout, Console: "forkvm-agent: listening"}
	if got, want := qe.Error(), "engine: start w: guest agent did not answer in time; the guest's console ended: forkvm-agent: listening"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
}
