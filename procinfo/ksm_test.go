package procinfo

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestReadKSM: the settings and the saving are read from their files; a host without
// the run file has no KSM (an error), a malformed run is ErrBadFormat, and files a
// kernel lacks (general_profit) read as 0.
func TestReadKSM(t *testing.T) {
	dir := t.TempDir()
	if _, err := readKSM(filepath.Join(dir, "none")); err == nil {
		t.Error("no KSM directory: no error")
	}
	write := func(name, v string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("run", "1\n")
	write("pages_to_scan", "100\n")
	write("sleep_millisecs", "20\n")
	k, err := readKSM(dir)
	if err != nil || k != (KSM{Run: 1, PagesToScan: 100, SleepMillisecs: 20}) {
		t.Errorf("without general_profit: %+v, %v", k, err)
	}
	write("general_profit", "238804992\n")
	if k, err := readKSM(dir); err != nil || k.GeneralProfit != 238804992 {
		t.Errorf("general_profit: %+v, %v", k, err)
	}
	write("run", "x\n")
	if _, err := readKSM(dir); !errors.Is(err, ErrBadFormat) {
		t.Errorf("malformed run: %v, want ErrBadFormat", err)
	}
}
