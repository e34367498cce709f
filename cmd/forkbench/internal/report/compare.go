package report

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// ErrBadResult is returned when a file given to compare is not a result JSON object.
var ErrBadResult = errors.New("forkbench: not a result file")

// ResultDoc is one side of a comparison: its numbers and flags as dotted paths.
type ResultDoc struct {
	Name  string
	Nums  map[string]float64
	Flags map[string]bool
	// Bench, Metric and Status ("complete", "PARTIAL", or "complete: unknown" for a
	// document without the flag) head the comparison.
	Bench, Metric, Status string
}

// ReadResultDoc reads a result file.
func ReadResultDoc(path string) (ResultDoc, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return ResultDoc{}, err
	}
	return ParseResultDoc(path, b)
}

// ParseResultDoc decodes a result.json (or a published result whose "current" holds it).
func ParseResultDoc(name string, b []byte) (ResultDoc, error) {
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		return ResultDoc{}, fmt.Errorf("%w: %s: %v", ErrBadResult, name, err)
	}
	if cur, ok := doc["current"].(map[string]any); ok {
		doc = cur
	}
	if _, ok := doc["metric"].(string); !ok {
		return ResultDoc{}, fmt.Errorf("%w: %s: no metric", ErrBadResult, name)
	}
	d := ResultDoc{Name: name}
	d.Nums, d.Flags = flatResult(doc)
	d.Bench, _ = doc["bench"].(string)
	d.Metric, _ = doc["metric"].(string)
	d.Status = "complete: unknown"
	if c, ok := d.Flags["complete"]; ok {
		d.Status = map[bool]string{true: "complete", false: "PARTIAL"}[c]
	}
	if ok, has := d.Flags["ok"]; has && !ok {
		d.Status += ", ok=false"
	}
	return d, nil
}

var waveOfKey = regexp.MustCompile(`^extra\.(default_settings_|default_settings\.waves\.|waves\.)?wave(\d+)[._]`)

// partial says whether key of d belongs to a wave that d records as not complete.
func (d ResultDoc) partial(key string) bool {
	m := waveOfKey.FindStringSubmatch(key)
	if m == nil {
		return false
	}
	base := "extra.waves.wave" + m[2]
	if strings.HasPrefix(m[1], "default_settings") {
		base = "extra.default_settings.waves.wave" + m[2]
	}
	c, ok := d.Flags[base+".complete"]
	return ok && !c
}

// WriteComparison prints B / A for every numeric key both documents carry.
func WriteComparison(w io.Writer, a, b ResultDoc, all bool) error {
	fmt.Fprintf(w, "A: %s (%s, %s = %s, %s)\nB: %s (%s, %s = %s, %s)\n\n", a.Name, a.Bench, a.Metric, Fnum(a.Nums["value"]), a.Status,
		b.Name, b.Bench, b.Metric, Fnum(b.Nums["value"]), b.Status)
	var keys []string
	for k := range a.Nums {
		if _, ok := b.Nums[k]; !ok {
			continue
		}
		if !all && (strings.HasPrefix(k, "environment.") || strings.HasPrefix(k, "host.") || strings.HasPrefix(k, "build.")) {
			continue
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if len(keys) == 0 {
		_, err := fmt.Fprintln(w, "no numeric key in common")
		return err
	}
	width := len("key")
	for _, k := range keys {
		width = max(width, len(k))
	}
	fmt.Fprintf(w, "%-*s  %14s  %14s  %8s  %s\n", width, "key", "A", "B", "B/A", "flags")
	for _, k := range keys {
		va, vb := a.Nums[k], b.Nums[k]
		r := "-"
		if va != 0 {
			r = fmt.Sprintf("%.3f", vb/va)
		}
		var fl []string
		if a.partial(k) {
			fl = append(fl, "A partial")
		}
		if b.partial(k) {
			fl = append(fl, "B partial")
		}
		if k == "value" && a.Metric != b.Metric {
			fl = append(fl, "different metrics")
		}
		if _, err := fmt.Fprintf(w, "%-*s  %14s  %14s  %8s  %s\n", width, k, Fnum(va), Fnum(vb), r, strings.Join(fl, ", ")); err != nil {
			return err
		}
	}
	return nil
}
