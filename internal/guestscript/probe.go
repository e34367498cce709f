// Package guestscript holds guest shell scripts that more than one runner uses (the VM
// tests, their engine helper process, forkbench's benches), so that each is written
// once, with what was learnt about it.
package guestscript

import (
	"strconv"
	"strings"
)

// TrappedProcess is a shell script that starts, in the background, a process keeping
// secret in a shell variable and writing it to /tmp/said on SIGUSR1, and prints its PID
// once its trap is set (a USR1 sent before would end it: the signal's default action).
// It exits non-zero, printing nothing, when the trap is not set within 10 s.
func TrappedProcess(secret string) string {
	return "setsid sh -c 'v=" + secret + "; trap \"echo $v > /tmp/said\" USR1; : > /tmp/trapped.$$; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 & p=$!; " +
		"for i in $(seq 200); do [ -e /tmp/trapped.$p ] && break; sleep 0.05; done; [ -e /tmp/trapped.$p ] && echo $p"
}

// Counter is a shell script that starts, in the background, a counter of the guest's
// work: every 100 ms it writes its next value to CounterRAM and CounterDisk, then runs
// each (a command of its loop, which sees the value as $i). The script's last command
// is the background job, so `$!` after it is the counter's shell.
func Counter(each string) string {
	return "(i=0; while :; do i=$((i+1)); echo $i > " + CounterRAM + "; echo $i > " + CounterDisk + "; " + each +
		"sleep 0.1; done) > /dev/null 2>&1 &"
}

// The files Counter writes: in guest RAM and on the data disk.
const (
	CounterRAM  = "/dev/shm/c"
	CounterDisk = "/data/c"
)

// ReadNumbers is a shell script that prints the content of each file, one a line. The
// Counter's `echo >` empties its file before it writes: a read in between sees
// nothing, so an empty file is read again (up to 10 times, 10 ms apart).
func ReadNumbers(files ...string) string {
	return "for f in " + strings.Join(files, " ") +
		`; do for t in 1 2 3 4 5 6 7 8 9 10; do c=$(cat $f); [ -n "$c" ] && break; sleep 0.01; done; echo $c; done`
}

// Fill is a shell script that writes mib MiB of data to path, every 4 KiB page of it
// distinct and none zero, and prints nothing: copies of 1 MiB drawn once from
// /dev/urandom, each followed by its number, so that each copy is shifted against the
// page boundaries by a few more bytes than the one before (distinct pages for fewer
// than about a thousand copies, enough that a page served from the wrong place changes
// the file's checksum). Under TCG it writes about three times as fast as mib MiB
// drawn from /dev/urandom, whose generator the guest runs emulated. The file is a few
// bytes longer than mib MiB; path.seed holds the draw meanwhile.
func Fill(path string, mib int) string {
	seed := path + ".seed"
	return "head -c 1048576 /dev/urandom > " + seed + " && i=0; while [ $i -lt " + strconv.Itoa(mib) +
		" ]; do cat " + seed + "; echo $i; i=$((i+1)); done > " + path + " && rm " + seed
}
