//go:build linux

package main

import (
	"log"
	"os"
	"os/signal"
	"syscall"
)

// survivableSignals are the signals a process in the guest (root included) can send
// the agent that would end it. The kernel delivers to PID 1 only signals it has a
// handler for, but the Go runtime installs a handler for every signal and then exits
// on SIGTERM, SIGHUP, SIGINT, SIGALRM and the like, and crashes with a goroutine dump
// on SIGQUIT, SIGABRT and a SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP or SIGSYS that a
// process sent (a real fault still panics). PID 1 exiting panics the kernel: the VM
// dies. SIGKILL and SIGSTOP are never delivered to PID 1 from inside the guest.
var survivableSignals = []os.Signal{
	syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGILL, syscall.SIGTRAP,
	syscall.SIGABRT, syscall.SIGBUS, syscall.SIGFPE, syscall.SIGUSR1, syscall.SIGSEGV,
	syscall.SIGUSR2, syscall.SIGPIPE, syscall.SIGALRM, syscall.SIGTERM, syscall.SIGSTKFLT,
	syscall.SIGXCPU, syscall.SIGXFSZ, syscall.SIGVTALRM, syscall.SIGPWR, syscall.SIGSYS,
}

// maxSignalReports bounds the console lines about ignored signals, so a guest that
// sends them in a loop cannot flood the console through the agent.
const maxSignalReports = 16

// surviveSignals makes PID 1 ignore the signals in survivableSignals, reporting the
// first few on logger. It uses signal.Notify, not signal.Ignore: an ignored
// disposition is inherited across exec by every command the agent runs, a handled one
// is reset to the default, so commands still die of SIGTERM and Ctrl-C.
func surviveSignals(logger *log.Logger) {
	ch := make(chan os.Signal, 16)
	signal.Notify(ch, survivableSignals...)
	go func() {
		n := 0
		for sig := range ch {
			if n++; n <= maxSignalReports {
				logger.Printf("PID 1 ignores %v", sig)
			}
		}
	}()
}
