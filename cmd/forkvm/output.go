package main

import (
	"encoding/json"
	"os"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
)

// The CLI's --json prints the daemon's JSON objects (package api, docs/api.md): one
// schema for a VM and one for a checkpoint, whichever command prints them; lists are []
// when empty.

func vmObjects(infos []engine.Info) []serve.VMObject {
	out := make([]serve.VMObject, 0, len(infos))
	for _, inf := range infos {
		out = append(out, serve.NewVMObject(inf))
	}
	return out
}

func checkpointObjects(cks []api.CheckpointInfo) []api.CheckpointObject {
	out := make([]api.CheckpointObject, 0, len(cks))
	for _, c := range cks {
		out = append(out, api.NewCheckpointObject(c))
	}
	return out
}

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
