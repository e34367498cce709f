package main

import (
	"github.com/forkvm/forkvm/engine"
)

// The CLI's JSON has one schema for a VM and one for a checkpoint, whichever command
// prints them (ls, create, fork; checkpoint, checkpoints): engine's own JSON with a
// schema name. Keys are snake_case with their unit (_ns, _mib, _ms); lists are [] when
// empty.
const (
	vmSchema         = "forkvm.vm/v1"
	checkpointSchema = "forkvm.checkpoint/v1"
	forkEventSchema  = "forkvm.fork-event/v1"
)

// vmJSON is a VM as the CLI prints it.
type vmJSON struct {
	Schema string `json:"schema"`
	engine.Info
}

func vmObject(inf engine.Info) vmJSON { return vmJSON{Schema: vmSchema, Info: inf} }

func vmObjects(infos []engine.Info) []vmJSON {
	out := make([]vmJSON, 0, len(infos))
	for _, inf := range infos {
		out = append(out, vmObject(inf))
	}
	return out
}

// checkpointJSON is a checkpoint as the CLI prints it, with its live forks.
type checkpointJSON struct {
	Schema string `json:"schema"`
	engine.CheckpointInfo
}

func checkpointObjects(cks []engine.CheckpointInfo) []checkpointJSON {
	out := make([]checkpointJSON, 0, len(cks))
	for _, c := range cks {
		if c.Forks == nil {
			c.Forks = []string{}
		}
		out = append(out, checkpointJSON{Schema: checkpointSchema, CheckpointInfo: c})
	}
	return out
}

// forkEventJSON is one line of `fork --json`: a fork that became ready (with its VM
// object) or failed.
type forkEventJSON struct {
	Schema    string  `json:"schema"`
	Index     int     `json:"index"`
	Name      string  `json:"name"`
	OK        bool    `json:"ok"`
	LatencyMS float64 `json:"latency_ms"`
	Error     string  `json:"error,omitempty"`
	VM        *vmJSON `json:"vm,omitempty"`
}

func forkEventObject(ev engine.ForkEvent) forkEventJSON {
	out := forkEventJSON{Schema: forkEventSchema, Index: ev.Index, Name: ev.Name, OK: ev.Err == nil, LatencyMS: ms(ev.Latency())}
	if ev.Err != nil {
		out.Error = ev.Err.Error()
	} else {
		v := vmObject(ev.VM.Info())
		out.VM = &v
	}
	return out
}
