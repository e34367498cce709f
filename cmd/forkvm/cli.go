package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
)

// exitUsage is the exit status of a command line forkvm cannot parse (an unknown
// command or flag, a missing argument), as flag parsers and shells use it; a failed
// operation exits 1.
const exitUsage = 2

// usageError is a command line forkvm cannot parse: printed as one line, with no help
// text after it, and exit status exitUsage.
type usageError struct {
	msg  string
	flag string // an unknown flag's name without dashes, spelled in msg as dashed spells it
}

func (e *usageError) Error() string { return e.msg }

// runMain runs the forkvm command line args (args[0] is the program) and returns its exit
// status, having printed any error to stderr as one line (two with a hint).
func runMain(ctx context.Context, args []string, stderr io.Writer) int {
	err := newApp().Run(ctx, args)
	var ee exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	}
	msg := userMessage(err)
	var ue *usageError
	if errors.As(err, &ue) && ue.flag != "" {
		if typed := typedFlag(args, ue.flag); typed != "" {
			msg = strings.Replace(msg, "unknown flag "+dashed(ue.flag), "unknown flag "+typed, 1)
		}
	}
	if !strings.HasPrefix(msg, "forkvm") {
		msg = "forkvm: " + msg
	}
	fmt.Fprintln(stderr, msg)
	if h := errorHint(err); h != "" {
		fmt.Fprintln(stderr, "forkvm:", h)
	}
	if errors.As(err, &ue) || strings.HasPrefix(err.Error(), "usage: ") {
		return exitUsage
	}
	return 1
}

// usageErrors makes every command answer a command line it cannot parse with one
// usageError (urfave/cli prints "Incorrect Usage", the whole help and the error again,
// and spells an unknown --flag as -flag), and the top level answer an unknown command
// with one (it would print "No help topic" and exit 3).
func usageErrors(root *cli.Command) {
	var walk func(c *cli.Command)
	walk = func(c *cli.Command) {
		c.OnUsageError = func(ctx context.Context, cmd *cli.Command, err error, _ bool) error {
			return flagUsageError(cmd, err)
		}
		for _, s := range c.Commands {
			walk(s)
		}
	}
	walk(root)
	root.Action = func(ctx context.Context, cmd *cli.Command) error {
		if cmd.Args().Len() == 0 {
			return cli.ShowRootCommandHelp(cmd)
		}
		return unknownCommand(cmd, cmd.Args().First())
	}
}

// unknownCommand is the usageError for a word that names no subcommand of c, with the
// nearest one's name when one is near.
func unknownCommand(c *cli.Command, word string) error {
	var names []string
	for _, s := range c.Commands {
		if !s.Hidden {
			names = append(names, s.Names()...)
		}
	}
	msg := fmt.Sprintf("%s: unknown command %q", c.FullName(), word)
	if s := nearest(word, names); s != "" {
		return &usageError{msg: msg + fmt.Sprintf("; did you mean %q?", s)}
	}
	return &usageError{msg: msg + fmt.Sprintf(" (%s --help lists them)", c.FullName())}
}

// noArguments makes c and its subcommands that take no arguments (no ArgsUsage: ls,
// checkpoints, budget, ...) refuse one with a usageError before they open anything:
// urfave/cli hands extra words to the action, which ignored them (`forkvm ls w1` listed
// every VM, as if it were a filter). A command with subcommands says the word is none of
// them. It wraps the actions before helpWords does, so "help" still shows help.
func noArguments(c *cli.Command) {
	for _, s := range c.Commands {
		noArguments(s)
	}
	own := c.Action
	if own == nil || c.ArgsUsage != "" {
		return
	}
	c.Action = func(ctx context.Context, cmd *cli.Command) error {
		if cmd.Args().Len() == 0 {
			return own(ctx, cmd)
		}
		if len(cmd.Commands) > 0 {
			return unknownCommand(cmd, cmd.Args().First())
		}
		return &usageError{msg: fmt.Sprintf("%s: unexpected argument %q (%s takes none)", cmd.FullName(), cmd.Args().First(), cmd.FullName())}
	}
}

// undefinedFlag and badFlagValue are urfave/cli's errors for an unknown flag and for a
// value that does not parse, the flag's name without its dashes.
var (
	undefinedFlag = regexp.MustCompile(`^flag provided but not defined: -+(.+)$`)
	badFlagValue  = regexp.MustCompile(`^invalid value "(.*)" for flag -+([^:]+): (?:.*: )?(.*)$`)
)

// flagUsageError is the usageError for a flag parse error of cmd: an unknown flag with
// the nearest flag of cmd (or a global one), a bad value, anything else as it is.
func flagUsageError(cmd *cli.Command, err error) error {
	prefix := cmd.FullName()
	if m := badFlagValue.FindStringSubmatch(err.Error()); m != nil {
		return &usageError{msg: fmt.Sprintf("%s: invalid value %q for %s: %s", prefix, m[1], dashed(m[2]), m[3])}
	}
	m := undefinedFlag.FindStringSubmatch(err.Error())
	if m == nil {
		return &usageError{msg: fmt.Sprintf("%s: %v", prefix, err)}
	}
	var names []string
	for _, c := range cmd.Lineage() {
		for _, f := range c.Flags {
			if c != cmd && isLocal(f) {
				continue
			}
			names = append(names, f.Names()...)
		}
	}
	msg := fmt.Sprintf("%s: unknown flag %s", prefix, dashed(m[1]))
	if s := nearest(m[1], names); s != "" {
		msg += fmt.Sprintf("; did you mean %s?", dashed(s))
	} else {
		msg += fmt.Sprintf(" (%s --help lists its flags)", prefix)
	}
	return &usageError{msg: msg, flag: m[1]}
}

// typedFlag is flag (a name without dashes) as args spell it: "--cpu" for --cpu or
// --cpu=2, "-cpu" for -cpu; "" when no argument before "--" spells it.
func typedFlag(args []string, flag string) string {
	for _, a := range args {
		if a == "--" {
			break
		}
		name, _, _ := strings.Cut(a, "=")
		if strings.HasPrefix(name, "-") && strings.TrimLeft(name, "-") == flag {
			return name
		}
	}
	return ""
}

// isLocal reports whether f is a flag of its own command only (helpWords makes the
// flags of commands with subcommands local).
func isLocal(f cli.Flag) bool {
	type local interface{ IsLocal() bool }
	l, ok := f.(local)
	return ok && l.IsLocal()
}

// dashed spells a flag name as the README and help spell it: --name, -x for a
// one-letter alias (fork's --n is the exception help makes too: both parse).
func dashed(name string) string {
	if len(name) == 1 && name != "n" {
		return "-" + name
	}
	return "--" + name
}

// nearest is the only candidate word is a prefix of, else the candidate closest to word
// by edit distance when it is close enough to be what was meant (a third of word's
// length away, at least 1, 2 from four letters on); "" when none is.
func nearest(word string, candidates []string) string {
	var prefixed []string
	for _, c := range candidates {
		if len(word) >= 2 && strings.HasPrefix(c, word) {
			prefixed = append(prefixed, c)
		}
	}
	if len(prefixed) == 1 {
		return prefixed[0]
	}
	best, bestD := "", -1
	for _, c := range candidates {
		if d := editDistance(word, c); bestD < 0 || d < bestD {
			best, bestD = c, d
		}
	}
	limit := max(1, len(word)/3)
	if len(word) >= 4 {
		limit = max(limit, 2)
	}
	if bestD >= 0 && bestD <= limit {
		return best
	}
	return ""
}

// editDistance is the Levenshtein distance between a and b, with a transposition of two
// neighbours counted as one edit (optimal string alignment).
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}

// packagePrefix is a package's name at the start of an error's text or of a wrapped
// part of it ("engine: not found: vm x"): the sentinels keep it (their text is part of
// the API), the CLI shows what follows.
var packagePrefix = regexp.MustCompile(`(^|: )(engine|guest|vsockd|fleet|memfile|qmp|procinfo|client|serve|faultclass|qemu|tracefs|tracebundle|perf|natsembed|local|kcounters|forkvm|pull): `)

// notFound is the engine's text for a missing VM or checkpoint once its prefix is gone.
var notFound = regexp.MustCompile(`not found: (vm|checkpoint|no checkpoint or vm named) (` + nameChars + `)`)

// nameChars is what a VM or checkpoint name may be made of (engine.ValidateName).
const nameChars = `[A-Za-z0-9][A-Za-z0-9_.-]*`

// userMessage is err as the CLI prints it: without the package names its parts carry,
// and a missing VM or checkpoint said as what to do about it. errors.Is still sees the
// sentinels: only the printed text changes.
func userMessage(err error) string {
	msg := packagePrefix.ReplaceAllString(err.Error(), "$1")
	if errors.Is(err, engine.ErrNotFound) {
		msg = notFound.ReplaceAllStringFunc(msg, func(s string) string {
			m := notFound.FindStringSubmatch(s)
			switch m[1] {
			case "vm":
				return fmt.Sprintf("VM %q not found (forkvm ls lists them)", m[2])
			case "checkpoint":
				return fmt.Sprintf("checkpoint %q not found (forkvm checkpoints lists them)", m[2])
			}
			return fmt.Sprintf("%q not found: no checkpoint or VM has that name (forkvm checkpoints, forkvm ls)", m[2])
		})
	}
	return msg
}

// exitError carries a process exit code out of an action (exec's pass-through).
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// errorHint is a line that says where to look next after err ("" when none helps).
// Admission counts every forkvm VM on the host, whichever state directory it belongs
// to, so a refusal in an empty state directory needs the budget's own account.
func errorHint(err error) string {
	if errors.Is(err, engine.ErrAdmission) {
		return "`forkvm budget` shows what holds the host's budget (other state directories' VMs count too); fork takes --overcommit"
	}
	return ""
}

// subcommandNames are the words that stand where a VM or checkpoint name also may
// (`forkvm checkpoint rm NAME` against `forkvm checkpoint VM NAME`); the CLI refuses them
// as names so that every name it accepts can be used with every command.
var subcommandNames = map[string]bool{"rm": true, "pull": true}

// checkNewName refuses a name for a new VM or checkpoint that a command would read as a
// subcommand.
func checkNewName(name string) error {
	if subcommandNames[name] {
		return fmt.Errorf("%w: %q is a forkvm subcommand; pick another name", engine.ErrInvalidName, name)
	}
	return nil
}
