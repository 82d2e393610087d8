from reinforge.config import ArithmeticTaskConfig, CountdownTaskConfig
from reinforge.tasks.arithmetic import ArithmeticTasks, parse_answer
from reinforge.tasks.countdown import CountdownTasks, evaluate


def test_arithmetic_reward_and_parse():
    tasks = ArithmeticTasks(ArithmeticTaskConfig())
    t = tasks.train_task(0)
    assert tasks.reward(t.answer, t) == 1.0
    assert tasks.reward(f" {t.answer}\nmore", t) == 1.0
    assert tasks.reward(str(int(t.answer) + 1), t) == 0.0
    assert tasks.reward("the answer is " + t.answer, t) == 0.0  # the format is the number alone
    assert parse_answer("-12") == "-12" and parse_answer("") is None


def test_train_and_eval_disjoint_and_deterministic():
    cfg = ArithmeticTaskConfig(num_eval=300)
    a, b = ArithmeticTasks(cfg), ArithmeticTasks(cfg)
    eval_keys = {t.info["key"] for t in a.eval_tasks()}
    train = [a.train_task(i) for i in range(3000)]
    assert not eval_keys & {t.info["key"] for t in train}
    assert [t.messages for t in train[:50]] == [b.train_task(i).messages for i in range(50)]


def test_countdown_solutions_are_valid_and_checker_is_strict():
    tasks = CountdownTasks(CountdownTaskConfig(num_numbers=4))
    for i in range(50):
        t = tasks.train_task(i)
        assert tasks.reward(t.solution, t) == 1.0, t
    t = tasks.train_task(0)
    nums = t.info["numbers"]
    assert tasks.reward("+".join(map(str, nums)) + "+1", t) == 0.0  # extra number
    assert tasks.reward(str(t.info["target"]), t) == 0.0 or len(nums) == 1  # numbers unused
    assert tasks.reward("__import__('os')", t) == 0.0


def test_countdown_evaluator_refuses_everything_but_arithmetic():
    assert evaluate("2**100") is None
    assert evaluate("1/0") is None
    assert evaluate("(" * 500 + "1" + ")" * 500) is None
    assert evaluate("a+1") is None
    value, nums = evaluate("(3+5)/2")
    assert value == 4 and nums == [3, 5, 2]


def test_sentence_solutions_are_rejected_by_the_strict_checker():
    tasks = ArithmeticTasks(ArithmeticTaskConfig(sentence_fraction=0.5, partial_credit=0.0))
    sols = [tasks.train_task(i) for i in range(400)]
    sentences = [t for t in sols if t.solution.startswith("The answer is")]
    assert 150 < len(sentences) < 250  # about half
    for t in sols[:50]:
        expected = 0.0 if t.solution.startswith("The") else 1.0
        assert tasks.reward(t.solution, t) == expected
    # the operands do not depend on the style setting
    plain = ArithmeticTasks(ArithmeticTaskConfig())
    assert [t.messages for t in sols[:20]] == [plain.train_task(i).messages for i in range(20)]


def test_partial_credit_counts_matching_digits_from_the_right():
    tasks = ArithmeticTasks(ArithmeticTaskConfig(partial_credit=0.5))
    t = tasks.train_task(0)
    wrong_first = (
        str(int(t.answer) + 10 ** (len(t.answer) - 1)) if not t.answer.startswith("-") else "0"
    )
    assert tasks.reward(t.answer, t) == 1.0
    assert 0.0 < tasks.reward(wrong_first, t) < 0.5
    assert tasks.reward("no number", t) == 0.0
