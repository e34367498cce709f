package procinfo

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ksmDir is where the kernel's same-page merging reports and takes its settings.
const ksmDir = "/sys/kernel/mm/ksm"

// KSM is the host's same-page merging (/sys/kernel/mm/ksm): Run 1 means ksmd scans (0:
// nothing is merged), PagesToScan pages every SleepMillisecs; GeneralProfit is the
// memory merging saves, less its own metadata (bytes; 0 where the kernel does not
// report it).
type KSM struct {
	Run, PagesToScan, SleepMillisecs, GeneralProfit int64
}

// ReadKSM reads the host's KSM settings and saving; an error where the host has no
// KSM (its run file cannot be read).
func ReadKSM() (KSM, error) {
	return readKSM(ksmDir)
}

// readKSM is ReadKSM of the KSM directory dir.
func readKSM(dir string) (KSM, error) {
	num := func(name string) (int64, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return 0, err
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: %s: %v", ErrBadFormat, name, err)
		}
		return v, nil
	}
	var k KSM
	var err error
	if k.Run, err = num("run"); err != nil {
		return KSM{}, err
	}
	k.PagesToScan, _ = num("pages_to_scan")
	k.SleepMillisecs, _ = num("sleep_millisecs")
	k.GeneralProfit, _ = num("general_profit")
	return k, nil
}
