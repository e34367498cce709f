//go:build !linux

package measure

import (
	"os/exec"
	"strings"
)

func unameRelease() string {
	out, err := exec.Command("uname", "-r").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}
