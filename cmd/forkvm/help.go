package main

import (
	"bytes"
	"context"
	"io"
	"reflect"
	"regexp"
	"strings"

	"github.com/urfave/cli/v3"
)

// helpWidth is the column help text is wrapped at.
const helpWidth = 80

// init makes urfave/cli's help fit helpWidth columns (see reflowHelp). HelpPrinter is
// the CLI package's printing hook; this command sets it once.
func init() {
	printer := cli.HelpPrinterCustom
	cli.HelpPrinter = func(w io.Writer, templ string, data any) {
		var buf bytes.Buffer
		printer(&buf, templ, data, nil)
		w.Write(reflowHelp(buf.String(), helpWidth))
	}
}

// sliceRepeat is urfave/cli's " [ --flag X, -f X ]" after a repeatable flag's names.
var sliceRepeat = regexp.MustCompile(`\s*\[ -.*\]$`)

// reflowHelp re-lays out the flag lists of a help text (the "OPTIONS:" sections) in
// two columns whose second starts at most 30 columns in (a longer flag gets its usage
// on the next line), and wraps every line at width.
func reflowHelp(text string, width int) []byte {
	var out []string
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		out = append(out, wrapIndented(l, width, usageColumn(l))...)
		if !strings.HasSuffix(l, "OPTIONS:") {
			continue
		}
		type entry struct{ names, usage string }
		var block []entry
		for i+1 < len(lines) && strings.HasPrefix(lines[i+1], "   -") {
			i++
			f := strings.TrimSpace(lines[i])
			names, usage, _ := strings.Cut(f, "  ")
			names = sliceRepeat.ReplaceAllString(names, "")
			if !strings.HasPrefix(names, "--") {
				// A one-letter flag name (fork's n) is spelled as README and the
				// other commands spell flags: --n (urfave/cli prints -n; both parse).
				names = "-" + names
			}
			block = append(block, entry{names, strings.TrimSpace(usage)})
		}
		col := 0
		for _, e := range block {
			if len(e.names) <= 26 {
				col = max(col, len(e.names))
			}
		}
		col += 3 + 2
		for _, e := range block {
			head := "   " + e.names
			if len(head)+2 > col {
				out = append(out, head)
				head = ""
			}
			head += strings.Repeat(" ", col-len(head))
			wrapped := wrapIndented(head+e.usage, width, col)
			out = append(out, wrapped...)
		}
	}
	return []byte(strings.Join(out, "\n") + "\n")
}

func leadingSpaces(s string) int { return len(s) - len(strings.TrimLeft(s, " ")) }

// usageColumn is where a continuation of line starts: under its second column (after a
// run of two spaces, as in a command list), else under its first character.
func usageColumn(line string) int {
	lead := leadingSpaces(line)
	if i := strings.Index(line[lead:], "  "); i > 0 {
		rest := line[lead+i:]
		if col := lead + i + leadingSpaces(rest); col < len(line) && col <= 40 {
			return col
		}
	}
	return lead
}

// wrapIndented wraps line at width on spaces, continuation lines indented by indent.
func wrapIndented(line string, width, indent int) []string {
	if len(line) <= width {
		return []string{line}
	}
	var out []string
	pad := strings.Repeat(" ", indent)
	cur := line
	for len(cur) > width {
		cut := strings.LastIndexByte(cur[:width+1], ' ')
		if cut <= indent || cut <= leadingSpaces(cur) {
			cut = strings.IndexByte(cur[width:], ' ')
			if cut < 0 {
				break
			}
			cut += width
		}
		out = append(out, strings.TrimRight(cur[:cut], " "))
		cur = pad + strings.TrimLeft(cur[cut:], " ")
	}
	return append(out, cur)
}

// helpCmd is `forkvm help [COMMAND...]`: the help of any command, however deep
// (`forkvm help image create`), as its --help prints it.
func helpCmd() *cli.Command {
	return &cli.Command{
		Name:      "help",
		Aliases:   []string{"h"},
		Usage:     "show the help of forkvm or of a command",
		ArgsUsage: "[COMMAND [SUBCOMMAND]]",
		Action: func(ctx context.Context, cmd *cli.Command) error {
			app := newApp()
			app.Writer, app.ErrWriter = cmd.Root().Writer, cmd.Root().ErrWriter
			c := app
			for _, a := range cmd.Args().Slice() {
				parent := c
				if c = c.Command(a); c == nil || a == "help" {
					return unknownCommand(parent, a)
				}
			}
			// A fresh context: urfave/cli would otherwise take the running command
			// for the new one's parent.
			return app.Run(context.Background(), append(append([]string{"forkvm"}, cmd.Args().Slice()...), "--help"))
		},
	}
}

// helpWords (given each top-level command) makes "help" work below the top level where no name can stand for it: a
// command with subcommands shows its help for a lone "help" argument (`forkvm image
// help`, `forkvm checkpoint help`: checkpoint takes two names, so a lone word is never
// one), and its own flags are its own, not shown or accepted as its subcommands'
// global options. Without an action of its own it shows its help, and refuses an
// unknown subcommand.
func helpWords(c *cli.Command) {
	for _, sub := range c.Commands {
		helpWords(sub)
	}
	if len(c.Commands) == 0 {
		return
	}
	for _, f := range c.Flags {
		if v := reflect.ValueOf(f); v.Kind() == reflect.Pointer {
			if l := v.Elem().FieldByName("Local"); l.IsValid() && l.Kind() == reflect.Bool && l.CanSet() {
				l.SetBool(true)
			}
		}
	}
	own := c.Action
	c.Action = func(ctx context.Context, cmd *cli.Command) error {
		args := cmd.Args().Slice()
		if len(args) == 1 && args[0] == "help" || own == nil && len(args) == 0 {
			return cli.ShowSubcommandHelp(cmd)
		}
		if own == nil {
			return unknownCommand(cmd, args[0])
		}
		return own(ctx, cmd)
	}
}
