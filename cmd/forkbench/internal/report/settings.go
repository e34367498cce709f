package report

// Settings is a subcommand's environment.settings in result.json: its own flags, and the
// RunSettings every run records (embedded; runBench fills them in).
type Settings interface{ Common() *RunSettings }

// RunSettings are the settings every run records.
type RunSettings struct {
	Overcommit         float64 `json:"overcommit"`
	VMGenID            bool    `json:"vmgenid"`
	RestoreConcurrency int     `json:"restore_concurrency"`
	TBSizeMiB          int     `json:"tb_size_mib"`
	TCGThread          string  `json:"tcg_thread"`
	// MergePages is the engine's Config.MergePages (false: QEMU still offers guest RAM
	// to same-page merging, as it does by default).
	MergePages bool `json:"merge_pages"`
	// ZygoteShim is the engine's Config.ZygoteShim ("": QEMUs executed).
	ZygoteShim string `json:"zygote_shim,omitempty"`
}

// Common is s itself: every Settings embeds RunSettings.
func (s *RunSettings) Common() *RunSettings { return s }
