# failures.awk prints, after a failed `go test -v` run, each failing test's own lines
# (its t.Log/t.Error lines and its --- FAIL lines, not the engine's log lines): in a
# long run of parallel tests they are far above the end, where a reader of a CI log
# looks first. A message of several lines (a daemon's log in a t.Fatalf) keeps its
# indented continuation lines, up to 80 of them.
/^=== (RUN|NAME|CONT|PAUSE) / { cur = $3; cont = 0; next }
/^ *--- FAIL: / { failed[$3] = 1; order[++n] = $3; cont = 0; next }
/^ *--- (PASS|SKIP): / { cont = 0; next }
/_test\.go:[0-9]+: / && !/level=(INFO|DEBUG|WARN)/ && cur != "" { lines[cur] = lines[cur] $0 "\n"; cont = 80; next }
/_test\.go:[0-9]+: / { cont = 0; next }
cont > 0 && /^        / { lines[cur] = lines[cur] $0 "\n"; cont--; next }
{ cont = 0 }
END {
	if (n == 0) exit
	print "=== failures (each failing test's own lines, from the log above)"
	for (i = 1; i <= n; i++) {
		t = order[i]
		print "--- FAIL: " t
		printf "%s", lines[t]
	}
}
