"""`[task]` variants whose tasks are played as multi-turn episodes of an environment.

Why variants of `[task]` and not a separate `[env]` section: an environment and its tasks are one
choice (tic-tac-toe boards go with the game env, shop pages with the HTML tools); two sections
would let a config pair arithmetic prompts with a board game. One union on `name` keeps the choice
single, and `[task]` keeps meaning "what the model learns". The settings every env task shares
(turn and context limits, reward weights, tool rendering) come from `EnvTaskConfig`.

Each variant's `name` maps to its builder in `envs/sources.py` (`ENV_TASKS`); the RL loop, SFT,
evaluation and the memory planner tell an env task apart by its type (`ENV_TASK_CONFIGS`), never
by its name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from reinforge.config.base import Section
from reinforge.config.data import DatasetRowsSection
from reinforge.config.rewards import ScoredTask

ParserName = Literal["hermes", "llama3_json", "mistral"]


class EnvTaskConfig(ScoredTask):
    """Settings every env task shares."""

    max_turns: int = Field(8, ge=1, le=10_000)
    """Most assistant turns per episode. An episode still going after them ends unscored
    (`finish_max_turns`); tool envs score their last turn instead."""
    max_context: int | None = Field(None, ge=8)
    """Most token ids in one episode: the prompt, every assistant turn and every env reply. It is
    checked before each turn: an episode that cannot fit one more token ends there, counted as
    `context_overflows`, never cut silently. A turn generates at most rollout.max_new_tokens
    (eval.max_new_tokens in evaluation) or what is left of this, whichever is smaller. Default:
    the model's context."""
    render_tools: bool = True
    """Give the env's tool schemas to the chat template (`tools=`), which shows them to the model
    in the form it was trained on. Templates without tool support (builtin:tiny's ChatML) ignore
    them; the task's instructions then name the tools."""


class SandboxSection(Section):
    backend: Literal["auto", "bwrap", "rlimit"] = "auto"
    """Isolation of model-written code. "bwrap" (bubblewrap): own network, pid, mount and user (or
    uid) namespaces, a read-only system, private size-capped /tmp, /dev/shm and /run; contains
    every attack in docs/security.md, root or not. "rlimit": resource limits; as root also a fresh
    uid in its own namespaces (world-readable host files stay readable); without root the code
    runs as you and can reach your processes and files (the run summary lists what it leaves
    open). "auto": bwrap, and if bwrap cannot run here an error (never a silent downgrade): set
    "rlimit" explicitly to accept its gaps."""
    cpu_seconds: float = Field(5.0, gt=0.0)
    """CPU time limit of one tool call."""
    wall_seconds: float = Field(10.0, gt=0.0)
    """Wall-clock limit of one tool call, from the program's start (every process it started is
    killed)."""
    memory_mb: int = Field(512, gt=0)
    """Memory of one tool call: all its processes together (PSS, polled every 0.1 s), and the
    address space of each, in MB."""
    max_output_bytes: int = Field(16_384, gt=0)
    """stdout + stderr kept; past it the program is stopped."""
    max_file_mb: int = Field(16, gt=0)
    """Largest file the program may write, in MB."""
    max_disk_mb: int = Field(64, gt=0)
    """Files one tool call may keep, in MB: the size of its private /tmp (the work dir) and of
    its /dev/shm, each (both in memory)."""
    max_processes: int = Field(32, gt=0)
    """Most processes the program may run at once."""
    allow_uncontained: bool = False
    """On macOS and Windows there is no sandbox: the python tool refuses to run unless this is
    true, and then runs the code as you with only the time and output limits."""


class ToolArithmeticTaskConfig(EnvTaskConfig):
    name: Literal["tool_arithmetic"] = "tool_arithmetic"
    """Arithmetic the model may hand to a tool: it calls the tool, reads the result, and answers
    with the number alone (exact match)."""
    tool: Literal["calculator", "python"] = "calculator"
    """"calculator" (`calculator(expression)`, evaluated in-process) or "python" (`python(code)`,
    run in the sandbox of `[task.sandbox]`)."""
    question: Literal["value", "compare"] = "value"
    """"value": `a = 35, b = 33. What is a*b?`, answered with the number. "compare": `a = 35,
    b = 33, t = 1400. Is a*b above t?`, answered yes or no, with t drawn near the result (the
    calculator also compares: "a*b > t" gives true or false)."""
    min_digits: int = Field(2, ge=1, le=12)
    """Fewest digits of an operand."""
    max_digits: int = Field(3, ge=1, le=12)
    """Most digits of an operand."""
    operations: list[Literal["+", "-", "*"]] = ["*"]
    """Operations to draw from."""
    parser: ParserName = "hermes"
    """Tool-call format of the model: "hermes" (Qwen2.5 / Qwen3, `<tool_call>{json}</tool_call>`),
    "llama3_json" or "mistral"."""
    max_calls_per_turn: int = Field(4, ge=1, le=1000)
    """Tool calls run per assistant message; further ones are answered with an error."""
    sandbox: SandboxSection = SandboxSection()
    """The code sandbox (tool = "python" only)."""
    partial_credit: float = Field(0.0, ge=0.0, lt=1.0)
    """Reward for a wrong answer, scaled by the fraction of its digits (aligned from the right)
    that match, as in the arithmetic task; 0 gives a plain 0/1 reward. It tells RL which digits
    a nearly right answer got right (a half-copied tool result, say)."""
    demo_tool_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of the SFT reference demonstrations that call the tool before answering; the others
    answer at once (correctly: what a model that can do the sum in its head would write)."""
    num_eval: int = Field(200, ge=1, le=100_000)
    """Held-out tasks scored before and after training (never used for training)."""
    seed: int = Field(1234, ge=0)
    """Seed of the task generator (independent of `run.seed`)."""

    @model_validator(mode="after")
    def _digits_ordered(self) -> ToolArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"min_digits={self.min_digits} is above max_digits={self.max_digits}; "
                f"set max_digits >= {self.min_digits}"
            )
        return self


class HtmlTaskConfig(EnvTaskConfig):
    name: Literal["html"] = "html"
    """Questions about generated shop pages (product grids, order tables, links), answered by
    querying the page with BeautifulSoup tools: find, select, get_text, get_attribute."""
    show_page: bool = False
    """Also put the page's HTML in the prompt (an easier variant)."""
    parser: ParserName = "hermes"
    """Tool-call format of the model (see tool_arithmetic)."""
    num_eval: int = Field(64, ge=1, le=100_000)
    """Held-out tasks, each with a page of its own."""
    seed: int = Field(1234, ge=0)
    """Seed of the page and question generator."""


class SearchTaskConfig(EnvTaskConfig):
    name: Literal["search"] = "search"
    """Two-hop questions about a generated world of companies, founders and cities, answered
    through `search` (BM25 over the world's documents) and `open` tools."""
    num_companies: int = Field(60, ge=4, le=100_000)
    """Companies in the generated world (each has a document, as do founders and cities)."""
    parser: ParserName = "hermes"
    """Tool-call format of the model (see tool_arithmetic)."""
    num_eval: int = Field(45, ge=3, le=100_000)
    """Held-out questions: three about each of num_eval / 3 companies that training never asks
    about; a multiple of 3."""
    seed: int = Field(1234, ge=0)
    """Seed of the world and the questions."""

    @model_validator(mode="after")
    def _eval_split_fits(self) -> SearchTaskConfig:
        if self.num_eval % 3 or self.num_eval // 3 >= self.num_companies:
            works = min(max(3, self.num_eval // 3 * 3), (self.num_companies - 1) * 3)
            raise ValueError(
                f"num_eval = {self.num_eval} must be a multiple of 3 (three questions per "
                f"held-out company) below 3 x num_companies = {3 * self.num_companies}; "
                f"e.g. num_eval = {works}"
            )
        return self


class GameCaseSection(Section):
    game: str = "tic_tac_toe"
    """"tic_tac_toe", "connect_four", or an OpenSpiel game string after "openspiel:" (needs
    `pip install 'reinforge[games]'`), e.g. "openspiel:connect_four"."""
    opponent: Literal["random", "minimax", "mcts"] = "random"
    """The other side: uniformly random legal moves, minimax (alpha-beta), or OpenSpiel's MCTS."""
    opponent_depth: int | None = Field(None, ge=1)
    """Minimax plies (unset: to the end of the game) or MCTS simulations."""
    model_player: int | None = Field(None, ge=0, le=1)
    """The model's side: 0 moves first, 1 second; unset: drawn per task."""
    num_random_plies: int = Field(0, ge=0, le=100)
    """Random moves, by both sides, before the model's first turn (varied openings)."""


class GameTaskConfig(EnvTaskConfig):
    name: Literal["game"] = "game"
    """Board games against an opponent: each turn the model sees the board and answers with a
    move."""
    cases: list[GameCaseSection] = [GameCaseSection()]
    """What is played: a list of `[[task.cases]]` tables (game, opponent, side, opening); task i
    plays case i mod len(cases) with a seed of its own."""
    reward_mode: Literal["outcome", "legality"] = "outcome"
    """The env's score ("env"): "outcome" (1 win, 0.5 draw, 0 loss) or "legality" (the number
    of legal moves made). Both are also reported as the components "outcome" and
    "legal_moves"."""
    max_illegal_moves: int = Field(0, ge=0, le=1000)
    """Unreadable or illegal moves answered with an error and the board again; one more forfeits
    the game (0: the first one does)."""
    prompt_style: Literal["full", "compact"] = "full"
    """"full": the rules, a drawn board, the legal moves and the answer format; "compact": the
    board as rows of characters and the legal moves, in a few dozen tokens per turn (small models
    with short contexts)."""
    demo_best_move_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """SFT reference games: the share of moves a depth-limited minimax player picks (2 plies in
    tic-tac-toe, 4 elsewhere, unfinished boards scored by their open lines); the others are
    random legal moves."""
    num_eval: int = Field(64, ge=1, le=100_000)
    """Held-out games, split evenly over the cases (a multiple of len(cases))."""
    seed: int = Field(1234, ge=0)
    """Seed of the openings and of the opponent's choices."""

    @model_validator(mode="after")
    def _eval_split_fits(self) -> GameTaskConfig:
        num_cases = len(self.cases)
        if num_cases == 0:
            raise ValueError('cases is empty; list one, e.g. [{game = "tic_tac_toe"}]')
        if self.num_eval % num_cases:
            raise ValueError(
                f"num_eval = {self.num_eval} must be a multiple of the {num_cases} cases "
                f"(held-out games are split evenly); e.g. num_eval = "
                f"{max(1, self.num_eval // num_cases) * num_cases}"
            )
        return self


BUILTIN_TOOLS = ("python", "search", "open")


class ToolsTaskConfig(EnvTaskConfig, DatasetRowsSection):
    name: Literal["tools"] = "tools"
    """Your questions (rows from `path`, read as with name = "dataset"), answered through your
    tools and built-in ones in one episode; the answer is scored against the row's answer by
    the reward of its data_source (task.reward), plus task.rewards' other components."""
    tools: list[str] = Field(min_length=1)
    """The tools offered: your typed, documented Python functions, "path/to/file.py:function"
    or "package.module:function" (the signature and docstring become the schema), and the
    built-ins "python" (code in the sandbox of task.sandbox), "search" (the best hits for a
    query in task.corpus or from task.search_backend) and "open" (a hit's full text)."""
    corpus: str | None = None
    """The documents `search` looks through (BM25): a .jsonl / .json / .parquet / .csv file of
    rows with text (and optionally id and title), or a folder of .txt / .md files, one document
    each. Bad rows are reported with their row numbers, skipped or fatal as task.on_bad_row
    says."""
    search_backend: str | None = None
    """Instead of a corpus, your own search function, "path/to/file.py:function" or
    "package.module:function" taking (query: str, k: int) and returning a list of hits, each a
    text or a dict with text, title and id (a web search, a company index)."""
    system_prompt: str | None = None
    """A system message opening every episode (before the row's own, if it has one): how to
    use the tools and how to answer. Templates without tool support need it to name them."""
    parser: ParserName = "hermes"
    """Tool-call format of the model (see tool_arithmetic)."""
    max_calls_per_turn: int = Field(4, ge=1, le=1000)
    """Tool calls run per assistant message; further ones are answered with an error."""
    max_tool_output_chars: int = Field(2000, ge=1)
    """A tool reply longer than this is cut, with a note saying so."""
    sandbox: SandboxSection = SandboxSection()
    """The code sandbox of the "python" tool."""

    @model_validator(mode="after")
    def _tools_resolvable(self) -> ToolsTaskConfig:
        for i, ref in enumerate(self.tools):
            if ref not in BUILTIN_TOOLS and ":" not in ref:
                raise ValueError(
                    f"tools[{i}] = {ref!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                    'nor a function: write "path/to/file.py:function" or "package.module:function"'
                )
        if len(set(self.tools)) < len(self.tools):
            raise ValueError(f"tools = {self.tools} lists a tool twice; list each once")
        searches = {"search", "open"} & set(self.tools)
        if self.corpus is not None and self.search_backend is not None:
            raise ValueError(
                "corpus and search_backend both say what `search` looks through; set only one"
            )
        if searches and self.corpus is None and self.search_backend is None:
            raise ValueError(
                f"tools has {sorted(searches)}, which need documents: set corpus "
                '(e.g. corpus = "docs.jsonl", rows of {id, title, text}, or a folder of .txt '
                'files) or search_backend = "my_search.py:search"'
            )
        if not searches and (self.corpus or self.search_backend):
            raise ValueError(
                'corpus / search_backend is set but tools has no "search": add "search" '
                "to tools, or drop the setting"
            )
        return self


class UserEnvTaskConfig(EnvTaskConfig, DatasetRowsSection):
    name: Literal["env"] = "env"
    """Your own environment: a factory that returns an object speaking the Env protocol
    (`reset(task) -> EnvState`, `step(state, assistant) -> StepResult`; docs/environments.md),
    played over rows from your data or from a generator beside the factory."""
    env: str = Field(min_length=1)
    """The factory: "path/to/file.py:make_env", "package.module:make_env", or the name of an
    installed entry point in the group "reinforge.envs". Called once with `env_args`."""
    env_args: dict[str, Any] = {}
    """Keyword arguments for the factory, e.g. {max_results = 5, corpus = "docs.jsonl"}."""
    path: str | list[str] | None = None
    """The task rows, read as `[task] name = "dataset"` reads them (files, folders, HF datasets,
    generators; `columns.*`, splits and bad rows alike; rows need no answer: the env scores).
    Unset: a generator `rows(seed)` in the factory's own file or module."""

    @model_validator(mode="before")
    @classmethod
    def _has_path(cls, data: Any) -> Any:  # rows may come from the env's file: no path needed
        return data

    @model_validator(mode="after")
    def _consistent(self) -> UserEnvTaskConfig:
        if self.reward != "auto" or self.reward_by_source:
            raise ValueError(
                'task.reward and task.reward_by_source do not apply with name = "env": the env '
                'scores its episodes ("env"); weigh other rewards in task.rewards, e.g. '
                'rewards = [{name = "env"}, {name = "math", weight = 0.5}]'
            )
        if self.path is not None:
            from reinforge.data.spec import check_spec

            check_spec(self.to_spec(require_answer=False))
        return self

    def rows_path(self) -> str | list[str]:
        """`path`, or the `rows` generator beside the factory."""
        if self.path is not None:
            return self.path
        module, _, _ = self.env.rpartition(":")
        if not module:
            raise ValueError(
                f"task.env = {self.env!r} is an entry point: set task.path to the rows to play, "
                'e.g. task.path = "tasks.jsonl"'
            )
        return f"{module}:rows"


class AgentTaskConfig(EnvTaskConfig, DatasetRowsSection):
    name: Literal["agent"] = "agent"
    """Your agent, written against the `openai` client, trained unchanged: for each row and
    sample, reinforge calls `agent` with a client bound to the policy (an OpenAI-compatible
    endpoint served in-process by the engine) and trains on the exact tokens of its requests
    (docs/agents.md). Rows come from `path`, read as `[task] name = "dataset"` reads them."""
    agent: str = Field(min_length=1)
    """The agent function: "path/to/agent.py:run" or "package.module:run", sync or async, called
    as `run(agent, **agent_args)` with an `AgentContext` (`.client`, `.model`, `.messages`,
    `.answer`, ...); it returns the reward (a number) or named reward components (a dict)."""
    agent_args: dict[str, Any] = {}
    """Keyword arguments for the agent function, e.g. {max_steps = 4}."""
    max_turns: int = Field(32, ge=1, le=10_000)
    """Most requests one episode (one call of the agent) may make; further requests are refused
    with an error the agent sees (HTTP 400)."""
    agent_timeout_s: float = Field(300.0, gt=0.0)
    """Wall-clock limit of one agent call, requests included. Past it the episode fails
    (`agent_failed_timeout`) and its later requests are refused."""
    on_agent_failure: Literal["zero", "drop"] = "zero"
    """An agent that raises, times out, makes no request or returns something other than a
    number (or a dict of numbers): "zero" scores its episode 0 in its group (its tokens out of
    the loss); "drop" leaves the episode out of its group (groups of uneven size)."""
    max_failed_agent_share: float = Field(0.5, ge=0.0, le=1.0)
    """The run stops with an error when more than this share of a step's agents fail (1.0:
    never)."""
    reward_components: list[str] = []
    """Names of the components the agent returns in a dict besides "reward" (the "env"
    component), so `task.rewards` can weigh them, e.g. ["format", "tool_use"]."""

    @model_validator(mode="before")
    @classmethod
    def _has_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("path"):
            raise ValueError(
                'task.path is required with task.name = "agent": the rows the agent is called '
                'with, e.g. task.path = "questions.jsonl" (read as name = "dataset" reads it)'
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AgentTaskConfig:
        if ":" not in self.agent:
            raise ValueError(
                f'task.agent = {self.agent!r} names no function: write "path/to/agent.py:run" '
                'or "package.module:run"'
            )
        if self.reward != "auto" or self.reward_by_source:
            raise ValueError(
                'task.reward and task.reward_by_source do not apply with name = "agent": the '
                'agent scores its episodes ("env"); weigh other rewards in task.rewards'
            )
        from reinforge.data.spec import check_spec

        check_spec(self.to_spec(require_answer=False))
        return self


class VerifiersTaskConfig(EnvTaskConfig):
    name: Literal["verifiers"] = "verifiers"
    """An environment of the `verifiers` library (the `verifiers` extra, 0.3.1; its v0 classes,
    `verifiers.legacy`): its dataset's rows, its turns (`env_response`, its stop conditions) and
    its rubric's score, played as episodes of reinforge's rollout (docs/libraries.md)."""
    env: str = Field(min_length=1)
    """The environment: an installed environment's id or module ("vf-gsm8k", "my_env", which
    `verifiers.load_environment` imports and calls), or "path/to/file.py" or
    "path/to/file.py:function" / "module:function" for a function returning the environment."""
    env_args: dict[str, Any] = {}
    """Keyword arguments of the environment's `load_environment` (or of the function)."""
    num_eval: int = Field(100, ge=1, le=100_000)
    """Held-out rows: the first of the environment's eval dataset (seeded order), or, when it
    has none, rows drawn from its dataset and never trained on."""
    seed: int = Field(0, ge=0)
    """Seed of the held-out draw and of the training order."""
    parser: ParserName = "hermes"
    """The model's tool-call format, for environments with tools (ToolEnv): the calls found in
    an assistant turn are handed to the environment as its tool calls."""


ENV_TASK_CONFIGS = (
    ToolArithmeticTaskConfig,
    HtmlTaskConfig,
    SearchTaskConfig,
    GameTaskConfig,
    ToolsTaskConfig,
    UserEnvTaskConfig,
    AgentTaskConfig,
    VerifiersTaskConfig,
)


def is_env_task(task_cfg: object) -> bool:
    return isinstance(task_cfg, ENV_TASK_CONFIGS)
