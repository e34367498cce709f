package report

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// ReferenceJSON is the published baseline forkbench results are held against (Cua Spaces
// 0.15.0); every figure carries its source URL and machine.
//
//go:embed reference.json
var ReferenceJSON []byte

// ErrBadReference is returned when a reference file does not parse or a figure lacks a
// value, unit, source or known machine.
var ErrBadReference = errors.New("forkbench: bad reference file")

// Reference is reference.json: the published figures and the machines they ran on.
type Reference struct {
	Schema   string                `json:"schema"`
	Name     string                `json:"name"`
	About    string                `json:"about"`
	Machines map[string]RefMachine `json:"machines"`
	Figures  []RefFigure           `json:"figures"`
}

// RefMachine describes a machine of the reference: Short for tables, Full for reports.
type RefMachine struct {
	Short string `json:"short"`
	Full  string `json:"full"`
}

// RefFigure is one published figure and where forkbench's result carries the matching one.
type RefFigure struct {
	Key      string  `json:"key"`
	Label    string  `json:"label"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Stat     string  `json:"stat"`
	N        int     `json:"n"`
	Machine  string  `json:"machine"`
	Settings string  `json:"settings"`
	URL      string  `json:"url"`
	// Bench is the forkbench subcommand that measures it, Ours the dotted path of the
	// figure in that result.json (in OursUnit) and Metric, when set, the result's metric
	// it requires (e.g. fork_p50_ms, not a warm-pool run's).
	Bench    string `json:"bench"`
	Metric   string `json:"metric,omitempty"`
	Ours     string `json:"ours"`
	OursUnit string `json:"ours_unit"`
	// Wave and Pass name the fanout wave the figure belongs to (Pass "default_settings":
	// the wave run at the --overcommit asked for, before the one that fits), so a wave that was not complete shows as such.
	Wave int    `json:"wave,omitempty"`
	Pass string `json:"pass,omitempty"`
	// Overcommit is the vCPU overcommit the published wave ran at (only with Wave),
	// shown beside the one forkvm's wave ran at.
	Overcommit float64 `json:"overcommit,omitempty"`
}

// oursShownUnit is the unit our figure is shown in: the reference's, after conversion,
// except that forkvm's MiB stay MiB beside a published MB.
func (f RefFigure) oursShownUnit() string {
	if f.OursUnit == "MiB" {
		return "MiB"
	}
	return f.Unit
}

// ParseReference decodes and checks a reference file.
func ParseReference(b []byte) (*Reference, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var ref Reference
	if err := dec.Decode(&ref); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadReference, err)
	}
	if ref.Schema != "forkvm.reference/v1" {
		return nil, fmt.Errorf("%w: schema %q", ErrBadReference, ref.Schema)
	}
	seen := map[string]bool{}
	for _, f := range ref.Figures {
		switch {
		case f.Key == "" || seen[f.Key]:
			return nil, fmt.Errorf("%w: empty or repeated key %q", ErrBadReference, f.Key)
		case f.Value <= 0 || f.Unit == "" || f.OursUnit == "" || f.Ours == "" || f.Bench == "":
			return nil, fmt.Errorf("%w: %s: value, unit, bench and ours are required", ErrBadReference, f.Key)
		case f.Overcommit > 0 && f.Wave == 0:
			return nil, fmt.Errorf("%w: %s: an overcommit without a wave", ErrBadReference, f.Key)
		case !strings.HasPrefix(f.URL, "https://"):
			return nil, fmt.Errorf("%w: %s: source URL %q", ErrBadReference, f.Key, f.URL)
		case ref.Machines[f.Machine].Short == "":
			return nil, fmt.Errorf("%w: %s: unknown machine %q", ErrBadReference, f.Key, f.Machine)
		}
		if _, ok := unitScale(f.OursUnit, f.Unit); !ok {
			return nil, fmt.Errorf("%w: %s: cannot compare %s with %s", ErrBadReference, f.Key, f.OursUnit, f.Unit)
		}
		seen[f.Key] = true
	}
	return &ref, nil
}

// LoadReference is the embedded baseline (it is checked by the tests, so it always parses).
func LoadReference() *Reference {
	ref, err := ParseReference(ReferenceJSON)
	if err != nil {
		return &Reference{Machines: map[string]RefMachine{}}
	}
	return ref
}

// unitScale is the factor that turns a value in unit from into unit to. MiB and MB
// compare as published (the reference does not say which MB it means).
func unitScale(from, to string) (float64, bool) {
	norm := func(u string) string {
		if u == "MiB" {
			return "MB"
		}
		return u
	}
	from, to = norm(from), norm(to)
	switch {
	case from == to:
		return 1, true
	case from == "ms" && to == "s":
		return 1e-3, true
	case from == "s" && to == "ms":
		return 1e3, true
	}
	return 0, false
}

// flatten turns a JSON document into dotted paths: numbers in nums, booleans in flags.
func flatten(prefix string, v any, nums map[string]float64, flags map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		for k, c := range x {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			flatten(p, c, nums, flags)
		}
	case float64:
		nums[prefix] = x
	case bool:
		flags[prefix] = x
	}
}

// flatResult is a result.json as dotted paths. A published result (the reference's
// per-page JSON, which holds its result under "current") is read the same way.
func flatResult(doc map[string]any) (nums map[string]float64, flags map[string]bool) {
	if cur, ok := doc["current"].(map[string]any); ok {
		doc = cur
	}
	nums, flags = map[string]float64{}, map[string]bool{}
	flatten("", doc, nums, flags)
	return nums, flags
}

// CompareRow is one line of the side-by-side table: a reference figure and ours.
type CompareRow struct {
	Figure RefFigure
	// Ours is our figure in the reference's unit; Have says it was measured. Note says
	// why not, or that its wave was partial ("12/64 ready": no ratio is given then).
	Ours  float64
	Have  bool
	Note  string
	Ratio float64 // Ours / reference; 0 when there is none
	// Overcommit is the overcommit forkvm's wave ran at (0: unknown or not a wave).
	Overcommit float64
}

// CompareWithReference lines res up against the reference figures of its bench.
// A profiling run (Result.Profiling) has no rows: its figures are not benchmark figures.
func CompareWithReference(res *Result, ref *Reference) []CompareRow {
	if res.Profiling != "" {
		return nil
	}
	b, err := json.Marshal(res)
	if err != nil {
		return nil
	}
	var doc map[string]any
	if json.Unmarshal(b, &doc) != nil {
		return nil
	}
	nums, flags := flatResult(doc)
	var rows []CompareRow
	for _, f := range ref.Figures {
		if f.Bench != res.Bench || (f.Metric != "" && f.Metric != res.Metric) {
			continue
		}
		row := CompareRow{Figure: f}
		if f.Overcommit > 0 {
			row.Overcommit = nums["environment.settings.overcommit"]
			if v, ok := nums["environment.settings.fit.headline_overcommit"]; ok {
				row.Overcommit = v
			}
			if f.Pass != "" {
				row.Overcommit = nums["extra."+f.Pass+".overcommit"]
			}
		}
		if f.Wave > 0 {
			base := "extra.waves.wave" + strconv.Itoa(f.Wave)
			if f.Pass != "" {
				base = "extra." + f.Pass + ".waves.wave" + strconv.Itoa(f.Wave)
			}
			if c, ok := flags[base+".complete"]; ok && !c {
				row.Note = fmt.Sprintf("partial: %s/%s ready", Fnum(nums[base+".ready"]), Fnum(nums[base+".n"]))
			} else if !ok {
				continue // a wave this run did not ask for
			}
		}
		admitted := strings.HasSuffix(f.Key, "_admitted")
		if v, ok := nums[f.Ours]; ok && (row.Note == "" || admitted) {
			// A partial wave's figures cover its ready forks only: no value is shown for
			// them, except how far admission let it go, which is a count of the budget,
			// not a speed, so it gets no ratio.
			scale, _ := unitScale(f.OursUnit, f.Unit)
			row.Ours, row.Have = v*scale, true
			switch {
			case admitted:
				row.Note = "a count of the budget, no ratio"
				if f.Pass != "" {
					if b, ok := nums["extra."+f.Pass+".budget_vcpus"]; ok {
						row.Note = fmt.Sprintf("budget %s vCPUs; a count of the budget, no ratio", Fnum(b))
					}
				}
			default:
				row.Ratio = Ratio(row.Ours, f.Value)
			}
		} else if row.Note == "" {
			row.Note = "not measured"
		}
		rows = append(rows, row)
	}
	return rows
}

// HostShort names this host for the table: "2 CPUs AMD EPYC …, tcg".
func HostShort(h HostInfo) string {
	model := h.Model
	if len(model) > 24 {
		model = model[:24] + "…"
	}
	return fmt.Sprintf("%d CPUs %s, %s", h.CPUs, model, h.Accel)
}

// ComparisonTable renders rows as a markdown table (metric, forkvm, reference, ratio,
// Machines); "" when there are none.
func ComparisonTable(res *Result, ref *Reference, rows []CompareRow) string {
	if len(rows) == 0 {
		return ""
	}
	var sb strings.Builder
	sb.WriteString("| metric | forkvm | reference | forkvm / reference | machines (forkvm vs reference) |\n|---|---|---|---|---|\n")
	for _, r := range rows {
		f := r.Figure
		ours := r.Note
		switch {
		case r.Have && r.Note != "":
			ours = fmt.Sprintf("%s %s (%s)", Fnum(r.Ours), f.oursShownUnit(), r.Note)
		case r.Have:
			ours = fmt.Sprintf("%s %s", Fnum(r.Ours), f.oursShownUnit())
		}
		rat := "—"
		if r.Ratio > 0 {
			rat = fmt.Sprintf("%.2f×", r.Ratio)
		}
		fmt.Fprintf(&sb, "| %s (`%s`) | %s | [%s %s](%s) | %s | %s |\n", f.Label, f.Key, ours, Fnum(f.Value), f.Unit, f.URL, rat,
			r.Machines(res, ref))
	}
	return sb.String()
}

// TerminalTable renders rows as aligned text for stderr.
func TerminalTable(res *Result, ref *Reference, rows []CompareRow) string {
	if len(rows) == 0 {
		return ""
	}
	cells := [][]string{{"metric", "forkvm", "reference", "ratio", "machines"}}
	for _, r := range rows {
		f := r.Figure
		ours := r.Note
		if r.Have {
			ours = Fnum(r.Ours) + " " + f.oursShownUnit()
			if r.Note != "" {
				ours += " (" + r.Note + ")"
			}
		}
		rat := "-"
		if r.Ratio > 0 {
			rat = fmt.Sprintf("%.2fx", r.Ratio)
		}
		cells = append(cells, []string{f.Key, ours, Fnum(f.Value) + " " + f.Unit, rat, r.Machines(res, ref)})
	}
	width := make([]int, 5)
	for _, c := range cells {
		for i, s := range c {
			width[i] = max(width[i], len([]rune(s)))
		}
	}
	var sb strings.Builder
	for _, c := range cells {
		for i, s := range c {
			if i == len(c)-1 {
				sb.WriteString(s)
			} else {
				sb.WriteString(s + strings.Repeat(" ", width[i]-len([]rune(s))+2))
			}
		}
		sb.WriteString("\n")
	}
	return sb.String()
}

// Machines is the row's machines column: this host and the reference's machine, each
// with the overcommit its wave ran at when the figure is a fan-out wave's.
func (r CompareRow) Machines(res *Result, ref *Reference) string {
	ours, theirs := HostShort(res.Host), ref.Machines[r.Figure.Machine].Short
	if r.Figure.Overcommit > 0 && r.Figure.Wave > 0 {
		if r.Overcommit > 0 {
			ours += ", overcommit " + Fnum(r.Overcommit)
		}
		theirs += ", overcommit " + Fnum(r.Figure.Overcommit)
	}
	return ours + " vs " + theirs
}

// RefMachinesText lists the reference machines rows use, in full.
func RefMachinesText(ref *Reference, rows []CompareRow) string {
	seen := map[string]bool{}
	var out []string
	for _, r := range rows {
		if m := r.Figure.Machine; !seen[m] {
			seen[m] = true
			out = append(out, ref.Machines[m].Full)
		}
	}
	return strings.Join(out, "; ")
}
