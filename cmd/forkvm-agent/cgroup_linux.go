//go:build linux

package main

import (
	"bufio"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The commands' cgroup. A fork bomb run by a command (b(){ b|b& }; b) took every pid
// of the guest: the agent could neither fork a command nor, for about a minute, answer
// ("resource temporarily unavailable"). So commands run in cgroupDir, below the root
// cgroup the agent stays in, each in a cgroup of its own (vsockd.Server.ExecCgroup):
//   - all commands together hold at most the guest's pids less agentPidReserve, and its
//     memory less agentMemoryReserve(total) (then the OOM killer picks among them,
//     never the agent);
//   - one command (and all it forks) at most commandPids(total) tasks, so the next
//     command still starts;
//   - the cpu controller, where the kernel has it, weighs the agent's threads against
//     the commands as a whole, so the agent keeps its share of the CPU.
const (
	cgroupRoot      = "/sys/fs/cgroup"
	cgroupDir       = cgroupRoot + "/forkvm-exec"
	agentPidReserve = 1024
)

// agentMemoryReserve is the guest memory commands may not take: an eighth of it, at
// least 32 MiB.
func agentMemoryReserve(total int64) int64 { return max(total/8, 32<<20) }

// commandPids bounds one command's tasks: one per 512 KiB of guest memory, 64..4096.
func commandPids(total int64) int { return int(min(max(total/(512<<10), 64), 4096)) }

// setUpExecCgroup mounts cgroup2 if needed, makes cgroupDir with the limits above and
// returns it open with the per-command bound; nil (commands then run in the agent's
// cgroup, unbounded) where the kernel has no cgroup2 or it cannot be set up, which is
// logged.
func setUpExecCgroup(logger *log.Logger) (*os.File, int) {
	if !isMountpoint(cgroupRoot) {
		os.MkdirAll(cgroupRoot, 0o755)
		if err := unix.Mount("cgroup2", cgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			logger.Printf("commands run without limits: mount cgroup2: %v", err)
			return nil, 0
		}
	}
	for _, c := range []string{"+pids", "+memory", "+cpu"} {
		if err := os.WriteFile(filepath.Join(cgroupRoot, "cgroup.subtree_control"), []byte(c), 0); err != nil && c == "+pids" {
			logger.Printf("commands run without limits: enable pids: %v", err)
			return nil, 0
		}
	}
	if err := os.Mkdir(cgroupDir, 0o755); err != nil && !os.IsExist(err) {
		logger.Printf("commands run without limits: %v", err)
		return nil, 0
	}
	for _, c := range []string{"+pids", "+memory", "+cpu"} {
		os.WriteFile(filepath.Join(cgroupDir, "cgroup.subtree_control"), []byte(c), 0)
	}
	if b, err := os.ReadFile("/proc/sys/kernel/pid_max"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n > 2*agentPidReserve {
			os.WriteFile(filepath.Join(cgroupDir, "pids.max"), []byte(strconv.Itoa(n-agentPidReserve)), 0)
		}
	}
	total := memTotal()
	if total > 0 {
		os.WriteFile(filepath.Join(cgroupDir, "memory.max"), []byte(strconv.FormatInt(total-agentMemoryReserve(total), 10)), 0)
	}
	f, err := os.Open(cgroupDir)
	if err != nil {
		logger.Printf("commands run without limits: %v", err)
		return nil, 0
	}
	return f, commandPids(max(total, 256<<20))
}

// memTotal is the guest's memory in bytes (MemTotal), 0 if unknown.
func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err == nil {
				return kb << 10
			}
		}
	}
	return 0
}
