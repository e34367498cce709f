// Package testprobe holds guest shell scripts that the VM tests and their engine
// helper process both run, so that each is written once.
package testprobe

// TrappedProcess is a shell script that starts, in the background, a process keeping
// secret in a shell variable and writing it to /tmp/said on SIGUSR1, and prints its PID
// once its trap is set (a USR1 sent before would end it: the signal's default action).
// It exits non-zero, printing nothing, when the trap is not set within 10 s.
func TrappedProcess(secret string) string {
	return "setsid sh -c 'v=" + secret + "; trap \"echo $v > /tmp/said\" USR1; : > /tmp/trapped.$$; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 & p=$!; " +
		"for i in $(seq 200); do [ -e /tmp/trapped.$p ] && break; sleep 0.05; done; [ -e /tmp/trapped.$p ] && echo $p"
}
